"""CPU smoke runs of the benchmark scripts (tiny models; their timings mean nothing here)."""

import json

import numpy as np
import pytest

from conftest import rel_err


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny, make_tiny_draft, tiny_config

    root = tmp_path_factory.mktemp("bench")
    return make_tiny(root / "t", "llama", seed=4), make_tiny_draft(root / "d", tiny_config("llama"), seed=5,
                                                                  draft_vocab_size=128)


def paired_args(pair, out):
    return ["--target", str(pair[0]), "--draft", str(pair[1]), "--random-prompts", "--contexts", "64,160",
            "--prompts", "2", "--new-tokens", "8", "--repeats", "3", "--dtype", "float32", "--budget", "48",
            "--chunk", "8", "--k", "3", "--interval", "2", "--out", str(out)]


def test_paired_smoke_schema_and_equality(tiny_pair, tmp_path):
    from benchmarks import paired

    out = tmp_path / "paired.json"
    methods = paired.METHODS + ("diffspec-tree",)
    assert paired.main(paired_args(tiny_pair, out) + ["--methods", ",".join(methods), "--tree-nodes", "6",
                                                      "--tree-topk", "2"]) == 0
    data = json.loads(out.read_text())
    assert data["passed_equality"] is True and data["equality"] == "strict"
    env = data["environment"]
    assert env["git_commit"] and env["versions"]["jax"] and env["device"] and env["date"]
    assert set(data["models"]["target"]["files"]) >= {"config.json", "model.safetensors"}
    assert data["inputs"]["kind"] == "random token ids"
    assert [c["context"] for c in data["cases"]] == [64, 160]
    for case in data["cases"]:
        assert len(case["prompt_sha256"]) == 64 and not case["mismatches"]
        assert set(case["methods"]) == set(methods)
        assert case["methods"]["diffspec-tree"]["mean_tree_size"] == 6
        for m, stats in case["methods"].items():
            assert len(stats["decode_tokens_per_s"]["values"]) == 3 and stats["ttft_s"]["median"] > 0
            if m != "target":
                assert stats["speedup_vs_target"] > 0 and stats["mean_acceptance_length"]["median"] >= 1
        assert case["methods"]["diffspec"]["retrievals"] >= 1  # 160-token prompts exceed the history budget
        per = {m: case["methods"][m]["acceptance_length_per_prompt"] for m in methods[1:]}
        assert all(len(v) == 2 and all(x >= 1 for x in v) for v in per.values())
        assert set(case["comparisons"]) == {f"{a} vs {b}" for a in ("diffspec", "diffspec-tree")
                                            for b in methods[1:] if b != a}
        cmp = case["comparisons"]["diffspec vs eagle3-recent"]
        d = np.subtract(per["diffspec"], per["eagle3-recent"])
        assert cmp["mean_difference"] == pytest.approx(d.mean()) and cmp["wins"] + cmp["ties"] + cmp["losses"] == 2


def test_paired_self_draft_smoke(tiny_pair, tmp_path):
    """``--draft self`` with a target: the self-drafting methods only, lossless, compared prompt by prompt."""
    from benchmarks import paired

    out = tmp_path / "paired_self.json"
    args = paired_args(tiny_pair, out)
    args[args.index("--draft") + 1] = "self"
    args[args.index("--contexts") + 1] = "160"
    assert paired.main(args + ["--repeats", "1", "--no-warmup"]) == 0
    data = json.loads(out.read_text())
    (case,) = data["cases"]
    assert data["passed_equality"] is True and data["models"]["draft"] is None
    assert list(case["methods"]) == ["target", "self-recent", "self-diffspec"] and not case["mismatches"]
    assert set(case["comparisons"]) == {"self-diffspec vs self-recent"}
    assert case["methods"]["self-diffspec"]["retrievals"] >= 1


def test_paired_sampled_self_draft(tiny_pair, tmp_path, monkeypatch):
    """``--temperature``: every method samples (with the given draft sampling), repeat r with seed ``--seed + r``,
    outputs are not compared token by token, and each prompt's acceptance is its mean over the repeats."""
    import diffspec_jax as dj
    from benchmarks import paired

    calls, real = [], dj.generate

    def recording(target, draft, prompts, **kw):
        res = real(target, draft, prompts, **kw)
        calls.append((draft, kw["seed"], kw["sampling"], kw["spec"].draft_sampling,
                      res.stats.acceptance_length_per_sequence))
        return res

    monkeypatch.setattr(dj, "generate", recording)
    out = tmp_path / "paired_sampled.json"
    args = paired_args(tiny_pair, out)
    args[args.index("--draft") + 1] = "self"
    args[args.index("--contexts") + 1] = "160"
    args[args.index("--repeats") + 1] = "2"
    assert paired.main(args + ["--no-warmup", "--methods", "target,self-diffspec", "--temperature", "0.8",
                               "--top-p", "0.9", "--draft-sampling", "sample", "--seed", "7"]) == 0
    data = json.loads(out.read_text())
    assert data["equality"] == "not checked (sampled)" and data["passed_equality"] is True
    assert [(c[0] is None, c[1]) for c in calls] == [(True, 7), (False, 7), (False, 8), (True, 8)]  # ABBA
    assert all(c[2] == dj.SamplingConfig(temperature=0.8, top_p=0.9) and c[3] == "sample" for c in calls)
    per = data["cases"][0]["methods"]["self-diffspec"]["acceptance_length_per_prompt"]
    assert per == pytest.approx(np.mean([calls[1][4], calls[2][4]], axis=0))
    with pytest.raises(SystemExit, match="greedy runs"):
        paired.main(args + ["--temperature", "0.8", "--tie-tolerance", "0.1"])


def test_paired_difference_counts_and_interval():
    from benchmarks.paired import paired_difference

    rng = np.random.default_rng(21)
    b = rng.uniform(1.5, 3.0, 40)
    a = b + rng.normal(0.2, 0.05, 40)  # A above B on (nearly) every prompt
    a[:3] = b[:3]  # three ties
    r = paired_difference(list(a), list(b), seed=1)
    d = a - b
    assert (r["wins"], r["ties"], r["losses"]) == (int((d > 0).sum()), 3, int((d < 0).sum()))
    assert r["mean_difference"] == pytest.approx(d.mean())
    se = d.std(ddof=1) / np.sqrt(len(d))  # the bootstrap interval is close to the normal one here
    assert r["ci95"][0] == pytest.approx(d.mean() - 1.96 * se, abs=0.5 * se)
    assert r["ci95"][1] == pytest.approx(d.mean() + 1.96 * se, abs=0.5 * se) and r["ci95"][0] > 0
    flat = paired_difference(list(b + rng.normal(0, 0.3, 40)), list(b), seed=1)
    assert flat["ci95"][1] - flat["ci95"][0] > 3 * (r["ci95"][1] - r["ci95"][0])  # 6x the spread: a wider interval
    assert paired_difference(list(a), list(b), seed=1) == r  # seeded


def test_paired_fails_on_a_mismatch(tiny_pair, tmp_path, monkeypatch):
    """A method whose greedy output differs from target-only decoding fails the run."""
    from benchmarks import paired

    real = paired.run_method

    def broken(method, *args):
        tokens, row = real(method, *args)
        if method == "diffspec":
            tokens = [t[:3] + [(t[3] + 1) % 256] + t[4:] for t in tokens]
        return tokens, row

    monkeypatch.setattr(paired, "run_method", broken)
    out = tmp_path / "paired.json"
    args = paired_args(tiny_pair, out)
    args[args.index("--contexts") + 1] = "64"
    assert paired.main(args + ["--methods", "target,diffspec", "--repeats", "1", "--no-warmup"]) == 1
    data = json.loads(out.read_text())
    assert data["passed_equality"] is False
    assert data["cases"][0]["mismatches"]["diffspec"][0]["first_divergence"] == 3


def test_kernel_benchmark_quick(tmp_path):
    from benchmarks import kernels

    out = tmp_path / "k.json"
    assert kernels.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["kernel"] for r in data["results"]} == {"gather_rope_write", "chunk_scores", "draft_attention",
                                                      "cache_attention"}
    assert all(r["rel_err_vs_reference"] < 1e-2 for r in data["results"]) and data["copy_bandwidth"]["bytes_per_s"] > 0
    assert kernels.main(["--quick", "--only", "cache_attention", "--cache-options", "block=16,splits=2", "--out",
                         str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["kernel"] == "cache_attention" and r["plan"]["splits"] == 2 and r["rel_err_vs_reference"] < 1e-2


def test_long_context_anatomy_quick(tmp_path):
    from benchmarks import long_context

    out = tmp_path / "lc.json"
    assert long_context.main(["--quick", "--contexts", "256", "--batches", "1", "--repeats", "1", "--out",
                              str(out)]) == 0
    data = json.loads(out.read_text())
    case = data["cases"][0]
    for key in ("target_decode_step_s", "target_verify_step_s", "draft_propose_full_s", "draft_propose_diffspec_s",
                "cycle_full_s", "cycle_diffspec_s", "chunk_scores_s", "selection_s", "gather_rope_write_s",
                "retrieve_s", "hbm_floor_s"):
        assert case[key] > 0, key
    assert set(case["projected_speedup"]) == {"1.5", "2.0", "3.0", "4.0"}
    assert "random" in data["weights"]


def test_long_context_self_draft_quick(tmp_path):
    """The self-draft anatomy runs and reports; no jitted function embeds the target's weights as constants (a
    closure over the parameters, which at 8B shapes is 16 GB of constants and a compile that never ends)."""
    import warnings

    import jax

    from benchmarks import long_context

    out = tmp_path / "lc_self.json"
    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 16 << 10)  # the tiny target's weights are ~MBs
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="A large amount of constants")
            assert long_context.main(["--quick", "--draft", "self", "--contexts", "256", "--batches", "1",
                                      "--repeats", "1", "--inner", "2", "--iters", "2", "--chunk", "16",
                                      "--self-budgets", "128", "--self-acceptance", str(tmp_path / "none.json"),
                                      "--out", str(out)]) == 0
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)
    case = json.loads(out.read_text())["cases"][0]
    row = case["self_draft"]["128"]
    for key in ("self_step_s", "self_propose_s", "rebuild_s", "retrieve_s", "cycle_s"):
        assert row[key] > 0, key
    assert row["working_set_slots"] == 128 and "draft_propose_full_s" not in case
    assert row["self_step_over_target_step"] == pytest.approx(row["self_step_s"] / case["target_decode_step_s"])
    assert set(row["projected_speedup"]) == {"1.5", "2.0", "3.0", "4.0"}


def test_decode_ablation_variants_agree_and_report(tmp_path):
    """Every layout / projection variant of the ablation computes the same step (same weights, same cache values in
    either layout); the quick run reports times and compiled memory for each."""
    import jax.numpy as jnp

    from benchmarks import decode_ablation as da, long_context

    cfg, _ = long_context.shapes(True)
    params = long_context.random_target(cfg).params
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 3)), jnp.int32)
    start = jnp.asarray([40, 77], jnp.int32)
    logits = {v: np.asarray(da.variant_call(cfg, v, params, 2, 256)[0](toks, start)) for v in da.VARIANTS}
    for v, lg in logits.items():
        assert lg.shape == (2, 1, cfg.vocab_size)
        assert rel_err(lg, logits["library"]) < 2e-2, v  # bf16 weights: products may round differently
    out = tmp_path / "abl.json"
    assert da.main(["--quick", "--cases", "256x2", "--memory", "256x2", "--trace", "", "--repeats", "1",
                    "--inner", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {(r["variant"], r["tokens"]) for r in data["times"] if r.get("ms", 0) > 0} == {
        (v, t) for v in da.VARIANTS for t in (1, 5)}
    assert {r["variant"] for r in data["memory"]} == set(da.VARIANTS)


def test_paired_on_held_out_recall_prompts(tmp_path):
    """The default prompt source: held-out packages of the demo pair's corpus, here the recall workload (prompts
    end re-emitting a file far back); the JSON names each prompt and how much of its file target-only output copies."""
    from benchmarks import paired

    out = tmp_path / "paired.json"
    assert paired.main(["--workload", "recall", "--contexts", "512", "--prompts", "2", "--new-tokens", "8",
                        "--repeats", "1", "--methods", "target,diffspec", "--dtype", "float32", "--budget", "256",
                        "--chunk", "32", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["passed_equality"] is True and "recall" in data["inputs"]["kind"]
    assert "argparse" not in data["inputs"]["packages"] and len(data["inputs"]["held_out_sha256"]) == 64
    case = data["cases"][0]
    assert [p["distance"] >= 384 for p in case["prompts"]] == [True, True]
    assert 0.0 <= case["target_copied_fraction"] <= 1.0
    assert case["methods"]["diffspec"]["retrievals"] >= 1


def test_copy_probe_sequences_and_accuracy():
    from benchmarks.copy_probe import copy_accuracy, copy_sequences

    rng = np.random.default_rng(2)
    doc = rng.integers(1, 900, 3000).astype(np.int32)
    seqs = copy_sequences(doc, 1000, span=20, gap=50, count=3, seed=0)
    text = doc.tobytes()
    for kind, s in seqs.items():
        assert s.shape == (3, 90) and s.dtype == np.int32
        assert np.array_equal(s[:, :20], s[:, 70:])  # the passage, again after the gap
        assert all(row[20:70].tobytes() in text for row in s)  # natural filler
    assert all(row[:70].tobytes() in text for row in seqs["natural"])  # passage + the text that follows it
    assert np.array_equal(seqs["natural"][:, 20:70], seqs["random"][:, 20:70])
    assert not any(row[:20].tobytes() in text for row in seqs["random"])
    s = seqs["natural"]
    pred = np.full_like(s, -1)
    pred[:, :-1] = s[:, 1:]  # perfect predictions everywhere
    first, second = copy_accuracy(pred, s, 20, 50)
    assert first.tolist() == [1.0] * 3 and second.tolist() == [1.0] * 3
    pred[:, 70:79] = -1  # the second occurrence's tokens 2..10 wrong
    pred[1, 0] = -1
    first, second = copy_accuracy(pred, s, 20, 50)
    assert np.allclose(second, 10 / 19) and np.allclose(first, [1.0, 18 / 19, 1.0])
    with pytest.raises(SystemExit, match="too few"):
        copy_sequences(doc[:60], 1000, span=20, gap=50, count=1, seed=0)


def test_distinct_ngram_share():
    from benchmarks.copy_probe import distinct_ngram_share

    rng = np.random.default_rng(4)
    assert distinct_ngram_share(rng.permutation(50).tolist()) == 1.0
    assert distinct_ngram_share([7, 3] * 4) == pytest.approx(2 / 5)  # a loop: two 4-grams out of five
    assert distinct_ngram_share([5, 5, 5, 5, 5, 5]) == pytest.approx(1 / 3)
    assert distinct_ngram_share([1, 2, 3]) == 1.0  # no 4-gram at all


def test_copy_probe_on_the_demo_target_matches_transformers(tmp_path):
    """The probe's accuracies on the demo target, recomputed from the same sequences with transformers (torch)."""
    import jax.numpy as jnp
    import torch
    import transformers

    from benchmarks import copy_probe
    from diffspec_jax import demo, load_draft, load_target
    from diffspec_jax.corpus import build_corpus, encode_documents
    from diffspec_jax.models import eagle3

    out = tmp_path / "probe.json"
    assert copy_probe.main(["--gaps", "40", "--span", "24", "--passages", "2", "--greedy-prompts", "2",
                            "--greedy-context", "300", "--greedy-new-tokens", "12", "--free-running-shown", "8",
                            "--free-running-tokens", "8", "--layers", "--draft", str(demo.draft_dir()),
                            "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    entry = data["targets"][0]
    assert entry["path"].endswith("target") and entry["weights"] and "git_commit" in data["environment"]
    assert {(r["kind"], r["gap"]) for r in entry["rows"]} == {("natural", 40), ("random", 40)}
    tok = transformers.AutoTokenizer.from_pretrained(demo.target_dir())
    doc = max((e.ids for e in encode_documents(tok, build_corpus().held_out)), key=len)
    assert entry["held_out_document_tokens"] == len(doc)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo.target_dir(), dtype=torch.float32)
    seqs = copy_probe.copy_sequences(doc, hf.config.vocab_size, 24, 40, 2, seed=0)
    draft = load_draft(demo.draft_dir(), load_target(demo.target_dir(), "float32"), dtype="float32")
    used = np.asarray(draft.params["d2t"]) + np.arange(draft.params["d2t"].shape[0])
    assert entry["draft"]["aux_layers"] == list(draft.aux_layers) and entry["draft"]["weights"]
    for row in entry["rows"]:
        with torch.no_grad():
            pred = hf(torch.as_tensor(seqs[row["kind"]], dtype=torch.long)).logits.argmax(-1).numpy()
        first, second = copy_probe.copy_accuracy(pred, seqs[row["kind"]], 24, 40)
        assert np.abs(first - row["per_passage"]["first"]).max() <= 2 / 23  # float near-ties may flip a token
        assert np.abs(second - row["per_passage"]["second"]).max() <= 2 / 23
        assert row["second_occurrence_accuracy"] == pytest.approx(float(np.mean(row["per_passage"]["second"])))
        # free-running: transformers' greedy continuation of the sequence cut 8 tokens into the second occurrence
        free = row["free_running"]
        for seq, ours, share in zip(seqs[row["kind"]], free["tokens"], free["per_passage"]["match_share"]):
            with torch.no_grad():
                theirs = hf.generate(torch.as_tensor(seq[None, :72], dtype=torch.long), max_new_tokens=8,
                                     min_new_tokens=8, do_sample=False)[0, 72:].tolist()
            assert ours == theirs and share == pytest.approx(float(np.mean(np.asarray(theirs) == seq[72:80])))
        assert free["match_share"] == pytest.approx(float(np.mean(free["per_passage"]["match_share"])))
        # logit lens and draft agreement, recomputed from transformers' hidden states
        with torch.no_grad():
            hs = hf(torch.as_tensor(seqs[row["kind"]], dtype=torch.long), output_hidden_states=True).hidden_states
        n = hf.config.num_hidden_layers
        lens = row["layer_lens"]
        assert lens["layers"] == [*range(1, n), "final"]
        for i in range(1, n):
            with torch.no_grad():
                guess = hf.lm_head(hf.model.norm(hs[i])).argmax(-1).numpy()
            _, theirs = copy_probe.copy_accuracy(guess, seqs[row["kind"]], 24, 40)
            assert np.abs(np.asarray(lens["per_passage"])[:, i - 1] - theirs).max() <= 2 / 23
        assert np.allclose(np.asarray(lens["per_passage"])[:, -1], row["per_passage"]["second"])
        agree = row["draft_agreement"]
        assert len(agree["first"]) == len(agree["second"]) == 4
        aux = np.concatenate([hs[i].numpy() for i in draft.aux_layers], axis=-1)
        for seq, feats, pred, a_first, a_second in zip(seqs[row["kind"]], aux, pred, agree["per_passage"]["first"],
                                                       agree["per_passage"]["second"]):
            # entry i (token i + 1, features of token i) guesses token i + 2 at step 0; the probe's TTT unroll of
            # 4 steps leaves the sequence's last 2 tokens without a step-0 guess
            _, lg = eagle3.forward(draft.config, draft.params, jnp.asarray(seq[None, 1:]),
                                   jnp.asarray(feats[None, :-1]))
            guess = used[np.asarray(lg[0]).argmax(-1)]
            hits = np.full(len(seq), np.nan)
            hits[2:] = guess[:-1] == pred[1:-1]
            hits[len(seq) - 2:] = np.nan
            ref = copy_probe.occurrence_means(hits, 24, 40)
            assert abs(a_first[0] - ref[0]) <= 2 / 22 and abs(a_second[0] - ref[1]) <= 2 / 21
    # greedy writing: the same continuations from transformers' greedy generate, shares from the documents' text
    rep = entry["greedy_repetition"]
    docs = {e.name: e.ids for e in encode_documents(tok, build_corpus().held_out)}
    assert len(rep["prompts"]) == len(rep["greedy_tokens"]) == 2
    for p, ours, share, held in zip(rep["prompts"], rep["greedy_tokens"], rep["per_prompt"]["greedy"],
                                    rep["per_prompt"]["held_out"]):
        ids = docs[p["doc"]][p["start"]:p["start"] + 300]
        with torch.no_grad():
            theirs = hf.generate(torch.as_tensor(np.asarray(ids)[None], dtype=torch.long), max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False)[0, 300:].tolist()
        assert ours == theirs and share == copy_probe.distinct_ngram_share(theirs)
        assert held == copy_probe.distinct_ngram_share(docs[p["doc"]][p["start"] + 300:p["start"] + 312].tolist())
    assert rep["greedy_distinct_share"] == pytest.approx(float(np.mean(rep["per_prompt"]["greedy"])))
    with pytest.raises(SystemExit, match="at most --span"):
        copy_probe.main(["--span", "24", "--free-running-shown", "8", "--free-running-tokens", "20",
                         "--out", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match="one per target"):
        copy_probe.main(["--draft", str(demo.draft_dir()), "--draft", str(demo.draft_dir()),
                         "--out", str(tmp_path / "bad.json")])


def test_e2e_benchmark_quick(tmp_path):
    """benchmarks/e2e.py end to end on tiny shapes: generate() twice per method (the second call compiles
    nothing), device steps beside it, the targets computed from the rows."""
    from benchmarks import e2e

    out = tmp_path / "e2e.json"
    assert e2e.main(["--quick", "--contexts", "128", "--batches", "1", "--new-tokens", "6", "--methods",
                     "target,diffspec", "--repeats", "1", "--inner", "1", "--iters", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (case,) = data["cases"]
    rows = {r["method"]: r for r in case["methods"]}
    assert set(rows) == {"target", "diffspec"} and "error" not in case
    for r in rows.values():
        assert r["compile_call"]["compile_s"] > 0 and r["compile_s"] == 0  # the timed call reuses every program
        assert r["new_tokens_per_sequence"] == 6 and 0 < r["ttft_s"] <= r["wall_s"]
        assert r["host_syncs"] <= r["cycles"]  # one read per block of cycles, not per cycle
    assert rows["target"]["decode_s_per_token"] == pytest.approx(rows["target"]["decode_s"] / 5)
    assert rows["target"]["over_device_step"] == pytest.approx(
        rows["target"]["decode_s_per_token"] / case["device"]["target_decode_step_s"])
    assert "projected" in rows["diffspec"] and "target_only_128x1_within_1.05x_device_step" in data["targets"]


def captured_figure(monkeypatch, plot, payload, path):
    """Run a benchmark's ``plot`` and return the figure it drew (kept open)."""
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert plot(payload, path) == path.name and path.stat().st_size > 0
    return figs[0]


def check_axes(fig):
    """Every panel has both axis labels; no title names an absolute path."""
    texts = [fig._suptitle.get_text() if fig._suptitle else ""] + [a.get_title() for a in fig.axes]
    assert not any("/tmp" in t or "/root" in t or "/work" in t for t in texts), texts
    for a in fig.axes:
        assert a.get_xlabel() and a.get_ylabel(), a.get_title()


def test_paired_plot_intervals_reference_line_and_titles(tmp_path, monkeypatch):
    from benchmarks import paired

    rng = np.random.default_rng(0)
    per = {c: {m: list(1 + rng.random(6) * (2 if m == "diffspec" else 1)) for m in ("eagle3-full", "diffspec")}
           for c in (2048, 8192)}
    payload = {"settings": {"methods": ["target", "eagle3-full", "diffspec"]},
               "environment": {"device": "cpu"}, "models": {"target": {"path": str(tmp_path / "my_model")}},
               "cases": [{"context": c, "methods": {m: {"speedup_vs_target": 1.2,
                                                        "mean_acceptance_length": {"median": float(np.mean(v))},
                                                        "acceptance_length_per_prompt": v}
                                                    for m, v in per[c].items()}} for c in per]}
    fig = captured_figure(monkeypatch, paired.plot, payload, tmp_path / "p.png")
    check_axes(fig)
    assert fig._suptitle.get_text() == "cpu"  # a model outside the repository: no path in the title
    speed, acc = fig.axes
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in speed.get_lines())  # the 1.0x line
    assert [t.get_text() for t in speed.get_xticklabels()] == ["2K", "8K"]
    # the error bars are the seeded bootstrap interval of the mean over prompts
    bars = acc.containers[1]  # diffspec
    segs = bars.lines[2][0].get_segments()
    for seg, c in zip(segs, (2048, 8192)):
        lo, hi = paired.bootstrap_ci(per[c]["diffspec"], 0)
        assert seg[0][1] == pytest.approx(lo) and seg[1][1] == pytest.approx(hi)
    assert "6 prompts" in acc.get_title()
    payload["models"]["target"]["path"] = "/somewhere/else/diffspec_jax/demo/pair/target"
    fig = captured_figure(monkeypatch, paired.plot, payload, tmp_path / "p.png")
    assert fig._suptitle.get_text() == "cpu, target diffspec_jax/demo/pair/target"  # repository-relative
    # with per-prompt comparisons: a third panel, each difference's interval against the zero line
    for c in payload["cases"]:
        c["comparisons"] = {"diffspec vs eagle3-full": paired.paired_difference(
            c["methods"]["diffspec"]["acceptance_length_per_prompt"],
            c["methods"]["eagle3-full"]["acceptance_length_per_prompt"])}
    fig = captured_figure(monkeypatch, paired.plot, payload, tmp_path / "p.png")
    check_axes(fig)
    diff = fig.axes[2]
    assert any(list(line.get_ydata()) == [0.0, 0.0] for line in diff.get_lines())  # the zero line
    segs = diff.containers[0].lines[2][0].get_segments()
    for seg, c in zip(segs, payload["cases"]):
        assert [seg[0][1], seg[1][1]] == pytest.approx(c["comparisons"]["diffspec vs eagle3-full"]["ci95"])


def test_long_context_plot_of_a_committed_result(tmp_path, monkeypatch):
    from benchmarks import long_context

    root = __import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    payload = json.loads((root / "attention_h200" / "run2_b1_b8.json").read_text())  # --steps-only: a ratio panel
    fig = captured_figure(monkeypatch, long_context.plot, payload, tmp_path / "l.png")
    check_axes(fig)
    ratio = fig.axes[3]
    assert ratio.get_ylabel() == "ratio" and any(list(line.get_ydata()) == [1.0, 1.0] for line in ratio.get_lines())
    assert [t.get_text() for t in ratio.get_xticklabels()] == ["8K", "32K", "64K"]
    prefill = fig.axes[0]  # log scale with plain-number ticks
    assert prefill.get_yscale() == "log" and len(prefill.get_yticks()) >= 3


def test_flash_prefill_quick(tmp_path):
    """The prefill-attention comparison runs and writes its rows (on a CPU only the dense stand-in runs)."""
    from benchmarks import flash_prefill

    out = tmp_path / "fp.json"
    assert flash_prefill.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["results"][0]
    assert row["impl"] == "cudnn_lse" and row["median_s"] > 0 and row["rel_err_out"] == 0.0
    assert row["flops"] == 2 * 1 * 4 * 64 * 128 * 128 and data["matmul_peak"]["flop_per_s"] > 0


def test_self_projection_formula_and_files(tmp_path):
    """``self_projection.py``: self-diffspec pays retrieval + rebuild every N cycles (N of the acceptance run),
    self-recent neither; every cell of every steps file is projected at every acceptance source."""
    from benchmarks import self_projection

    steps = {"environment": {"device": "gpu", "git_commit": "abc"}, "cases": [
        {"context": 65536, "batch": 8, "target_decode_step_s": 0.02,
         "self_draft": {"4096": {"self_step_s": 0.006, "cycle_s": 0.05, "retrieve_s": 0.002, "rebuild_s": 0.004},
                        "2048": {"self_step_s": 0.005, "cycle_s": 0.04, "retrieve_s": 0.001, "rebuild_s": 0.002}}},
        {"context": 8192, "batch": 1, "target_decode_step_s": 0.01}]}  # no self-draft cells
    (tmp_path / "steps.json").write_text(json.dumps(steps))

    def paired_json(name, interval, acc_d, acc_r):
        case = {"context": 16384, "methods": {"self-diffspec": {"mean_acceptance_length": {"median": acc_d}},
                                              "self-recent": {"mean_acceptance_length": {"median": acc_r}}},
                "comparisons": {"self-diffspec vs self-recent": {"mean_difference": acc_d - acc_r}}}
        path = tmp_path / name
        path.write_text(json.dumps({"settings": {"budget": 1024, "k": 4, "interval": interval, "workload": "recall"},
                                    "cases": [{"context": 4096, "methods": {}}, case]}))
        return path

    every, fourth = paired_json("a.json", None, 4.4, 4.0), paired_json("b.json", 4, 3.0, 2.5)
    out = tmp_path / "proj.json"
    assert self_projection.main(["--steps", str(tmp_path / "steps.json"), "--acceptance", f"every={every}",
                                 "--acceptance", f"fourth={fourth}", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [c["budget"] for c in data["cells"]] == [2048, 4096]
    c = data["cells"][0]
    assert c["self_step_over_target_step"] == pytest.approx(0.25)
    assert c["projected_speedup"]["every"]["self-diffspec"] == pytest.approx(4.4 * 0.02 / (0.04 + 0.003))
    assert c["projected_speedup"]["fourth"]["self-diffspec"] == pytest.approx(3.0 * 0.02 / (0.04 + 0.003 / 4))
    assert c["projected_speedup"]["every"]["self-recent"] == pytest.approx(4.0 * 0.02 / 0.04)
    assert data["acceptance"]["every"]["interval"] == 1 and data["acceptance"]["every"]["context"] == 16384
    assert (tmp_path / "proj.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="NAME=FILE"):
        self_projection.main(["--steps", str(tmp_path / "steps.json"), "--acceptance", str(every), "--out", str(out)])


# ------------------------------------------------------------------------------------------ issue 37: paging
class _PrefixServer:
    """What the load generator expects of the server's prefix cache, in pure Python: a request reuses the longest
    run of cached full pages of its prompt (at most all but its last token); when it finishes, the full pages of
    its prompt + answer below ``len - lag`` join the cache (``lag`` 1: the answer's last token is never computed;
    more: a speculative engine that keeps its newest rows out of the cache)."""

    def __init__(self, page, answer_len, lag):
        self.page, self.answer_len, self.lag = page, answer_len, lag
        self.cached, self.prompts = set(), []

    async def send(self, prompt):
        self.prompts.append(list(prompt))
        hit = 0
        while hit + self.page <= len(prompt) - 1 and tuple(prompt[:hit + self.page]) in self.cached:
            hit += self.page
        answer = [len(self.prompts)] * self.answer_len
        context = list(prompt) + answer
        for end in range(self.page, len(context) - self.lag + 1, self.page):
            self.cached.add(tuple(context[:end]))
        return {"ttft_s": 0.05 if hit else 1.0, "prompt_tokens": len(prompt), "answer": answer, "end_s": 0.0,
                "cached_tokens": hit, "cached_source": "usage"}


def _shared_run(page, answer_len, lag, clients):
    import argparse
    import asyncio

    from benchmarks import serve_load

    server = _PrefixServer(page, answer_len, lag)
    args = argparse.Namespace(seed=3, question_len=8, followup_len=8)
    run = asyncio.run(serve_load.shared_document(server.send, 64, clients, args, vocab=500))
    return run, server


def test_serve_load_shared_document_turns_and_page_accounting():
    """The shared-document workload sends the first question alone, the others one at a time, then every client's
    follow-up (its prompt + its answer + a new message); the summary counts hits against the document's full pages
    and the follow-ups' pages against every full page the previous turn computed, and finds a missed last page."""
    from benchmarks import serve_load

    run, server = _shared_run(page=16, answer_len=9, lag=1, clients=3)
    assert len(server.prompts) == 6 and [len(p) for p in server.prompts[:3]] == [72] * 3
    assert server.prompts[0][:64] == server.prompts[1][:64] != server.prompts[0][64:] != server.prompts[1][64:]
    for i, turn in enumerate([run["first"], *run["hits"]]):  # follow-up i = prompt i + answer i + a message
        assert server.prompts[3 + i][:81] == server.prompts[i] + turn["answer"] and len(server.prompts[3 + i]) == 89
    s = serve_load.shared_summary(run, 16)
    assert s["shared_full_page_tokens"] == 64 and s["cached_fraction"]["each"] == [1.0, 1.0]
    assert s["cached_fraction"]["each_ge_0.99"] and s["hit_ttft_over_first"]["each"] == [0.05, 0.05]
    assert s["hit_ttft_over_first"]["each_le_0.1"] and s["requests"] == 6
    assert [f["full_pages_of_previous_turn"] for f in s["followups"]] == [5, 5, 5]  # (72 + 9 - 1) // 16
    assert [f["pages_hit"] for f in s["followups"]] == [5, 5, 5] and s["followups_hit_every_full_page"]
    lagged, _ = _shared_run(page=16, answer_len=9, lag=6, clients=3)  # the newest 6 rows never cached
    ls = serve_load.shared_summary(lagged, 16)
    assert [f["missed_pages"] for f in ls["followups"]] == [1, 1, 1] and not ls["followups_hit_every_full_page"]
    assert ls["cached_fraction"]["min"] == 1.0  # the document's pages are still hit
    off = {k: v for k, v in run.items()}  # caching off: every request prefills all of it
    off["hits"] = [dict(h, ttft_s=1.0, cached_tokens=0) for h in run["hits"]]
    rows = serve_load.compare_shared([
        {"workload": "shared-doc", "policy": "diffspec", "prefix_caching": True, "clients": 3,
         "documents": [dict(run, summary=s)]},
        {"workload": "shared-doc", "policy": "diffspec", "prefix_caching": False, "clients": 2,
         "documents": [dict(off, summary=serve_load.shared_summary(off, 16))]}])
    (row,) = rows
    assert row["hits_ttft_s"]["on_over_off"] == pytest.approx(0.05) and row["first_ttft_s"]["on_over_off"] == 1.0
    assert row["cached_fraction_min"] == 1.0 and row["missed_pages"] == 0 and row["hit_ttft_over_first_max"] == 0.05


def test_serve_load_streams_decoding_at_once_and_capacity():
    """Requests decoding at once from the clients' streams (first to last token; a one-chunk stream never counts,
    and one ending as another starts does not raise the peak); the response's cached tokens; the capacity
    workload's prompts and its paged / fixed comparison."""
    import argparse

    from benchmarks import serve_load

    def stream(first, last):
        return {"sent": 0.0, "chunks": [(first, "1 "), (last, "2 3 ")], "usage": None, "prompt_tokens": 4}

    results = [stream(1, 5), stream(2, 3), stream(3, 6), stream(4, 4), {"error": "HTTP 503"}]
    d = serve_load.decoding_concurrency(results)
    assert d["peak"] == 2 and d["window_s"] == 5 and d["mean"] == pytest.approx((1 + 2 + 2 * 2 + 1) / 5)
    assert d["series"][-1] == [6, 0]
    assert serve_load.summarize(results, ids_text=True)["decoding_at_once"]["peak"] == 2
    turn = serve_load._turn({**stream(1, 2), "usage": {"prompt_tokens_details": {"cached_tokens": 64}}})
    assert turn["answer"] == [1, 2, 3] and turn["ttft_s"] == 1 and turn["cached_source"] == "usage"
    assert serve_load._turn(stream(1, 2))["cached_tokens"] is None
    args = argparse.Namespace(seed=0, capacity_requests=7, capacity_prompt_lens="100,300,900",
                              capacity_max_model_len=512, capacity_new_tokens=12)
    lens = sorted(map(len, serve_load.capacity_prompts(args, 50)))
    assert lens == [100, 100, 100, 300, 300, 500, 500]  # 900 cut to 512 - 12

    def cap(kind, seqs, peak, tok_s):
        return {"workload": "capacity", "kind": kind, "max_num_seqs": seqs, "ready": {"pool_tokens": 4096},
                "server": {"decoding_at_once": {"peak": peak, "mean": peak / 2}, "output_tokens_per_s": tok_s,
                           "itl_s": {"p50": 0.01, "p99": 0.012, "p99_over_p50": 1.2}, "ttft_s": {}, "completed": 7,
                           "requests": 7, "metrics": {"diffspec_compiles_after_warmup": 0.0},
                           "paging": {"preemptions": 1}}}

    c = serve_load.compare_capacity([cap("paged", 16, 10, 300.0), cap("fixed", 4, 4, 250.0)])
    assert c["paged_over_fixed"] == {"decoding_peak": 2.5, "decoding_mean": 2.5, "output_tokens_per_s": 1.2}
    assert c["paged"]["preemptions"] == 1 and c["paged_itl_p99_over_p50_le_1.3"]


def test_paged_steps_helpers():
    """paged_steps.py: cells, a page table that is a permutation of the pool, both caches' reach in whole pages
    and attention tiles, and issue 37's lines from the measured rows."""
    from benchmarks import paged_steps

    assert paged_steps.parse_cells("8192x1, 32768X8,4096") == [(8192, 1), (32768, 8), (4096, 1)]
    pages = paged_steps.random_pages(3, 5, seed=1)
    assert pages.shape == (3, 5) and sorted(pages.ravel().tolist()) == list(range(15))
    assert not (np.diff(pages, axis=1) == 1).all()
    assert paged_steps.reach(8192 + 384, 64) == 8704 and paged_steps.reach(100, 512) == 512
    cell = {"context": 65536, "batch": 1, "decode_step_s": {"ratio": 1.02}, "verify_step_s": {"ratio": 1.07}}
    payload = {"cells": [cell], "prefill": [{"context": 65536, "width": 65536, "paged": 3.3, "ratio": 1.01}],
               "generate_prefill": [{"context": 65536, "prefill_s": 3.2}]}
    t = paged_steps.targets(payload)
    assert t["paged_decode_64k_b1_le_1.05x"]["met"] and not t["paged_verify_64k_b1_le_1.05x"]["met"]
    pre = t["paged_prefill_64k_width_65536_le_1.05x_generate"]
    assert pre["value"] == pytest.approx(3.3 / 3.2) and pre["met"] and pre["paged_over_contiguous"] == 1.01
    # issue 41's variants and lines: fp8 steps over the bf16 one at 128K x 1; 128K x 8 running where bf16 did not
    assert paged_steps.variants_of("paged", "auto,fp8") == ("paged", "paged-fp8")
    with pytest.raises(ValueError):
        paged_steps.variants_of("paged", "int4")
    cells = [{"context": c, "batch": b, "variants": v, "errors": e, "decode_step_s": d}
             for c, b, v, e, d in ((131072, 1, ["paged", "paged-fp8"], {}, {"paged": 2.0, "paged-fp8": 1.2}),
                                   (32768, 8, ["paged-fp8"], {}, {"paged-fp8": 1.6}),
                                   (131072, 8, ["paged-fp8"], {"paged": "OOM"}, {"paged-fp8": 9.0}))]
    t = paged_steps.fp8_targets(cells)
    assert t["paged-fp8_decode_128k_b1_le_0.75x_bf16_128k_b1"]["met"]
    assert not t["paged-fp8_decode_32k_b8_le_0.75x_bf16_128k_b1"]["met"]
    assert t["paged-fp8_runs_128k_b8"] == {"value": True, "met": True, "bf16_error": "OOM"} and len(t) == 3


def test_kv_fp8_kernel_sweep_tiny(tmp_path, monkeypatch):
    """The fp8 kernel sweep on tiny heads (interpreted): every variant runs, they agree to rounding, JSON + PNG."""
    from benchmarks import kv_fp8_kernel_sweep

    monkeypatch.setenv("TINY", "1")
    out = tmp_path / "s.json"
    assert kv_fp8_kernel_sweep.main(["--cells", "128x1x1", "--page-size", "16", "--variants", "short",
                                     "--out", str(out)]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert not cell["errors"] and set(cell["over_bf16"]) == {"bf16"} | {kv_fp8_kernel_sweep.name(v)
                                                                      for v in kv_fp8_kernel_sweep.SHORT}
    assert len(cell["max_diff_vs_first_fp8"]) == len(kv_fp8_kernel_sweep.SHORT)
    assert max(cell["max_diff_vs_first_fp8"].values()) < 2e-2  # bf16 vs float16 operands, bf16 outputs
    assert out.with_suffix(".png").stat().st_size > 0


def test_scripts_run_from_their_folder_do_not_shadow_installed_packages():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path; benchmarks.common drops it, so transformers (which
    probes for a `kernels` package) does not pick up benchmarks/kernels.py (copy_probe.py failed this way)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import benchmarks.common; "
            "import importlib.util; spec = importlib.util.find_spec('kernels'); "
            "assert spec is None or 'benchmarks' not in str(spec.origin), spec.origin; "
            "from transformers import LlamaConfig")
    run = subprocess.run([sys.executable, "-c", code, str(repo / "benchmarks"), str(repo)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
