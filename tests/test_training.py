"""Target LM training (optax, Orbax resume, HF export) and the EAGLE-3 draft trainer (TTT, export, CLI)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_logits, rel_err
from diffspec_jax import SpecConfig, generate, load_draft, load_target
from diffspec_jax.target import TargetModel
from diffspec_jax.training import OptimConfig, TokenStream, train_target


@pytest.fixture(scope="module")
def corpus_stream():
    """A small real corpus (the first standard-library files) and a 300-token BPE trained on it."""
    from diffspec_jax.corpus import build_corpus, train_tokenizer

    corpus = build_corpus(max_files=30)
    tok = train_tokenizer([d.text for d in corpus.train], 300)
    docs = [np.asarray(tok(d.text)["input_ids"], np.int32) for d in corpus.train]
    return tok, TokenStream(docs, tok.eos_token_id), corpus


@pytest.fixture(scope="module")
def trained_target(corpus_stream):
    from checkpoints_tools.make_tiny import tiny_config

    tok, stream, _ = corpus_stream
    cfg = tiny_config("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    params, history = train_target(cfg, stream, steps=120, batch=8, seq_len=64, progress=False, log_every=20,
                                   optim=OptimConfig(lr=3e-3, warmup_steps=10, total_steps=120), attention="dense")
    return TargetModel(cfg, params), history


def test_corpus_manifest_and_tokenizer(corpus_stream, tmp_path):
    from transformers import AutoTokenizer

    tok, stream, corpus = corpus_stream
    m = corpus.manifest
    assert m["python"] and len(m["train_sha256"]) == 64 and m["train_files"] == len(m["files"]["train"])
    assert all(d.text.startswith("# file: ") for d in corpus.train)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x + 1\n"
    assert back.decode(back(text)["input_ids"]) == text  # byte-level: lossless round trip
    assert len(stream) > 10_000


def test_target_training_loss_falls(trained_target):
    _, history = trained_target
    assert history[-1]["loss"] < history[0]["loss"] - 1.0


def test_training_resumes_from_orbax_checkpoints(corpus_stream, tmp_path):
    from checkpoints_tools.make_tiny import tiny_config

    tok, stream, _ = corpus_stream
    cfg = tiny_config("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    kw = dict(batch=4, seq_len=32, progress=False, log_every=1, optim=OptimConfig(lr=3e-3, warmup_steps=2,
                                                                                 total_steps=12))
    straight, _ = train_target(cfg, stream, steps=12, **kw)
    train_target(cfg, stream, steps=6, ckpt_dir=tmp_path / "ck", **kw)  # stops at step 6, checkpoint written
    resumed, hist = train_target(cfg, stream, steps=12, ckpt_dir=tmp_path / "ck", **kw)
    assert hist[0]["step"] == 7  # continued, not restarted
    for a, b in zip(np.asarray(straight["layers"][0]["wq"]).ravel()[:50], np.asarray(resumed["layers"][0]["wq"]).ravel()[:50]):
        assert abs(a - b) < 1e-5


def test_trained_target_exports_to_transformers(trained_target, tmp_path):
    import torch
    import transformers

    from checkpoints_tools.hf import save_hf

    model, _ = trained_target
    save_hf(tmp_path, model.config, model.params, dtype="float32")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 40))
    from diffspec_jax import forward

    assert rel_err(forward(load_target(tmp_path, "float32"), ids), hf_logits(hf, ids)) <= 1e-4


def test_ttt_steps_match_the_engines_chain_equations(trained_target, corpus_stream):
    """Step 0 of training-time test is the draft's reference forward; step 1 at entry t is chain step 1 from root
    t (draft token x_{t+2}, h2 fed back, RoPE position t + 1, attending to entries <= t and itself)."""
    from test_draft import NumpyDraft

    from diffspec_jax.models import eagle3, llama
    from diffspec_jax.train_draft import draft_config_for, ttt_logits

    target, _ = trained_target
    _, stream, _ = corpus_stream
    cfg = draft_config_for(target, 300, (0, 2, 3))
    params = eagle3.init_params(cfg, seed=3, dtype=jnp.float32, used_ids=np.arange(300))
    params["embed"] = target.params["embed"]
    window = jnp.asarray(stream.tokens[:18][None])
    t = 16
    _, aux = llama.forward_aux(target.config, target.params, window, aux_layers=(0, 2, 3))
    n = target.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"0..{n - 1}"):  # index n is no layer's input: refused, never left out
        llama.forward_aux(target.config, target.params, window, aux_layers=(0, n))
    steps = ttt_logits(cfg, params, aux[:, :t], window[:, 1:], 2)
    _, ref0 = eagle3.forward(cfg, params, window[:, 1:t + 1], aux[:, :t])
    np.testing.assert_allclose(steps[0], ref0, atol=2e-5)
    toks = np.asarray(window[0])
    feats = np.asarray(aux[0], np.float64)
    for root in (3, 15):
        ref = NumpyDraft(cfg, params)
        for e in range(root + 1):
            q, g = ref.entry(int(toks[e + 1]), feats[e], e, from_target=True)
        h2, _ = ref.attend_and_finish(q, g)
        q, g = ref.entry(int(toks[root + 2]), h2, root + 1, from_target=False)
        _, logits = ref.attend_and_finish(q, g)
        np.testing.assert_allclose(np.asarray(steps[1][0, root]), logits, atol=5e-5, rtol=1e-5)


def test_draft_training_export_and_lossless_generation(trained_target, corpus_stream, tmp_path):
    from diffspec_jax.train_draft import export_draft, train_draft

    target, _ = trained_target
    _, stream, _ = corpus_stream
    cfg, params, history = train_draft(target, stream, steps=100, batch=8, seq_len=64, ttt_steps=3,
                                       draft_vocab=200, aux_layers=(0, 2, 3), progress=False, log_every=25,
                                       optim=OptimConfig(lr=3e-3, warmup_steps=10, total_steps=100),
                                       eval_stream=stream, eval_every=50)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert history[-1]["eval_acceptance_length"] > 1.1
    export_draft(tmp_path, cfg, params, dtype="float32", history=history)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["draft_vocab_size"] == 200 and cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [0, 2, 3]
    draft = load_draft(tmp_path, target)
    prompts = [list(map(int, stream.tokens[1000:1080])), list(map(int, stream.tokens[4000:4130]))]
    base = generate(target, None, prompts, max_new_tokens=40, stop_token_ids=())
    res = generate(target, draft, prompts, max_new_tokens=40, spec=SpecConfig(num_speculative_tokens=3),
                   stop_token_ids=())
    assert res.tokens == base.tokens
    assert res.stats.mean_acceptance_length > 1.2  # the trained draft is accepted


def test_train_draft_cli_on_text_and_jsonl(trained_target, corpus_stream, tmp_path):
    from checkpoints_tools.hf import save_hf
    from diffspec_jax.train_draft import main

    target, _ = trained_target
    tok, _, corpus = corpus_stream
    save_hf(tmp_path / "target", target.config, target.params, dtype="float32")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "a.txt").write_text(corpus.train[0].text)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d.text}) for d in corpus.train[1:4]))
    code = main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                 "--out", str(tmp_path / "draft"), "--steps", "4", "--batch", "2", "--seq-len", "32",
                 "--ttt-steps", "3", "--draft-vocab", "128", "--aux-layers", "0,2,3", "--eval-every", "0",
                 "--rope-theta", "500000"])
    assert code == 0
    draft = load_draft(tmp_path / "draft", load_target(tmp_path / "target", "float32"))
    assert draft.config.draft_vocab_size == 128 and draft.aux_layers == (0, 2, 3)
    assert draft.config.rope.theta == 500000.0  # the draft's own RoPE base is written and read back
    assert (tmp_path / "draft" / "checkpoints").exists()
    assert main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "missing.txt"), "--out",
                 str(tmp_path / "x")]) == 2


def test_corpus_with_installed_package_sources():
    """Installed packages' sources join the training split (one document per directory, versions recorded); the
    held-out split is unchanged, and a missing package is named."""
    import numpy
    from diffspec_jax.corpus import build_corpus
    from diffspec_jax.errors import ConfigError

    base = build_corpus(max_files=40)
    more = build_corpus(max_files=40, extra_packages=("numpy",))
    assert more.manifest["extra_packages"] == {"numpy": numpy.__version__} and base.manifest["extra_packages"] == {}
    added = [d for d in more.train if d.name.startswith("numpy")]
    assert [d.name for d in more.train if not d.name.startswith("numpy")] == [d.name for d in base.train]
    assert len(added) > 10 and any(d.name == "numpy/linalg" for d in added)
    assert not any("/tests" in f for d in added for f in d.files)
    assert all(d.text.startswith("# file: numpy/") for d in added)
    assert more.manifest["held_out_sha256"] == base.manifest["held_out_sha256"]
    assert more.manifest["train_sha256"] != base.manifest["train_sha256"]
    with pytest.raises(ConfigError, match="not_a_package_xyz"):
        build_corpus(max_files=5, extra_packages=("not_a_package_xyz",))


def test_installed_package_copies_of_held_out_files_are_left_out(tmp_path, monkeypatch):
    from diffspec_jax.corpus import build_corpus

    std = tmp_path / "std"
    (std / "email").mkdir(parents=True)
    (std / "email" / "utils.py").write_text("def held():\n    return 1\n")
    (std / "heapq.py").write_text("def push(): pass\n")
    pkg = tmp_path / "site" / "fakepkg_diffspec"
    (pkg / "_vendor").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "_vendor" / "utils.py").write_text("def held():\n    return 1\n")  # a vendored held-out file
    (pkg / "_vendor" / "other.py").write_text("y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    c = build_corpus(root=std, held_out=("email",), extra_packages=("fakepkg_diffspec",))
    assert [d.name for d in c.held_out] == ["email"]
    files = {d.name: d.files for d in c.train}
    assert files == {"heapq": ["heapq.py"], "fakepkg_diffspec": ["fakepkg_diffspec/__init__.py"],
                     "fakepkg_diffspec/_vendor": ["fakepkg_diffspec/_vendor/other.py"]}


def _random_lines(rng, n: int) -> list[str]:
    return [f"value_{rng.integers(1 << 40):x} = compute_{rng.integers(1 << 40):x}(x)" for _ in range(n)]


def test_line_deduplicator_drops_files_mostly_seen_before():
    from diffspec_jax.corpus import LineDeduplicator
    from diffspec_jax.errors import ConfigError

    rng = np.random.default_rng(11)
    first, fresh = _random_lines(rng, 20), _random_lines(rng, 20)
    for threshold, kept in ((0.3, False), (0.6, True)):
        d = LineDeduplicator(threshold)
        assert d.keep("\n".join(first))
        half = "\n".join(first[:10] + fresh[:10] + ["x = 1"] * 50)  # short lines do not count
        assert d.keep(half) is kept
        assert d.keep("\n".join(first[:1] + fresh[10:])) and not d.keep("\n".join(first))  # 1/11 seen; all seen
        assert d.dropped_files == 1 + (not kept)
        assert d.summary()["dropped_chars"] == len("\n".join(first)) + (0 if kept else len(half))
    assert LineDeduplicator(0.3).keep("if x:\n    pass\n")  # nothing countable: kept
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError, match="threshold"):
            LineDeduplicator(bad)


def test_corpus_deduplication_keeps_the_first_copy_and_never_filters_held_out(tmp_path, monkeypatch):
    from diffspec_jax.corpus import build_corpus

    rng = np.random.default_rng(12)
    std = tmp_path / "std"
    (std / "email").mkdir(parents=True)
    a, b, c = (_random_lines(rng, 30) for _ in range(3))
    (std / "email" / "utils.py").write_text("\n".join(a + c[:5]) + "\n")  # held out, shares lines with heapq
    (std / "heapq.py").write_text("\n".join(a) + "\n")
    pkg = tmp_path / "site" / "fakepkg_dedup"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("\n".join(b) + "\n")
    (pkg / "models" / "copy.py").write_text("\n".join(a[:20] + c[:5]) + "\n")  # 20/25 lines from heapq
    (pkg / "models" / "own.py").write_text("\n".join(b[:5] + c[5:]) + "\n")  # 5/30 from __init__
    (pkg / "other").mkdir()
    (pkg / "other" / "dup.py").write_text("\n".join(b) + "\n# edited\n")  # all of __init__: dir emptied
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    plain = build_corpus(root=std, held_out=("email",), extra_packages=("fakepkg_dedup",))
    dedup = build_corpus(root=std, held_out=("email",), extra_packages=("fakepkg_dedup",), dedup_threshold=0.3)
    assert plain.manifest["dedup"] is None and len([f for d in plain.train for f in d.files]) == 5
    files = {d.name: d.files for d in dedup.train}
    assert files == {"heapq": ["heapq.py"], "fakepkg_dedup": ["fakepkg_dedup/__init__.py"],
                     "fakepkg_dedup/models": ["fakepkg_dedup/models/own.py"]}
    assert dedup.held_out[0].text == plain.held_out[0].text and dedup.held_out[0].files == ["email/utils.py"]
    dropped = [pkg / "models" / "copy.py", pkg / "other" / "dup.py"]
    assert dedup.manifest["dedup"] == {"threshold": 0.3, "min_chars": 16, "dropped_files": 2,
                                       "dropped_chars": sum(len(p.read_text()) for p in dropped)}
    assert dedup.manifest["train_chars"] == plain.manifest["train_chars"] - sum(
        len(f"# file: fakepkg_dedup/{p.relative_to(pkg).as_posix()}\n{p.read_text()}\n") for p in dropped)


def test_recall_spans_copy_a_passage_later_in_the_window():
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 50_000, 4000).astype(np.int32) for _ in range(3)]  # random ids: no accidental repeats
    plain = TokenStream(docs, 0)
    spans = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(16, 40))
    a, b = plain.batch(3, 6, 200, seed=1), spans.batch(3, 6, 200, seed=1)
    assert np.array_equal(b, spans.batch(3, 6, 200, seed=1))  # a function of (seed, step)
    text = plain.tokens.tobytes()
    for row, copied in zip(a, b):
        assert row.tobytes() in text  # plain windows are stretches of the stream
        changed = np.flatnonzero(row != copied)
        dst, n = changed[0], changed[-1] - changed[0] + 1
        assert 16 <= n <= 40 and np.array_equal(changed, np.arange(dst, dst + n))  # one block overwritten
        src = int(np.flatnonzero(row == copied[dst])[0])  # the passage's first copy, in the untouched window
        assert src + n <= dst and np.array_equal(copied[dst:dst + n], row[src:src + n])
        assert np.array_equal(copied[src:src + n], row[src:src + n])
    far = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(16, 40), recall_distance=0.7).batch(3, 6, 200, seed=1)
    for row, copied in zip(a, far):
        dst = int(np.flatnonzero(row != copied)[0])
        assert dst - int(np.flatnonzero(row == copied[dst])[0]) >= 140  # 70% of the window back
    noisy = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(16, 16), recall_noise=1.0).batch(3, 6, 200, seed=1)
    for row, copied in zip(a, noisy):
        changed = np.flatnonzero(row != copied)  # the source passage replaced, then copied: two blocks of 16
        src, dst = changed[0], changed[-16]
        assert len(changed) == 32 and np.array_equal(copied[src:src + 16], copied[dst:dst + 16])
        assert copied[src:src + 16].tobytes() not in row.tobytes()
    rand = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(64, 64), recall_random=0.5, vocab_size=7)
    kinds = []
    for row, copied in zip(plain.batch(4, 64, 400, seed=2), rand.batch(4, 64, 400, seed=2)):
        changed = np.flatnonzero(row != copied)
        dst = changed[-1] - 63  # the copy ends the changes; a random passage also changed its source
        passage = copied[dst:dst + 64]
        assert copied[:dst].tobytes().find(passage.tobytes()) >= 0  # its source is earlier in the window
        kinds.append(bool(passage.max() < 7))  # drawn from [1, 7): the stream's ids (1..50000) almost never are
        if kinds[-1]:
            assert passage.min() >= 1 and len(changed) > 64  # source and copy both rewritten
    assert 16 < sum(kinds) < 48  # about half the spans random
    missed = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(40, 40), recall_mismatch=0.25)
    assert np.array_equal(spans.batch(3, 6, 200, seed=1), TokenStream(docs, 0, recall_fraction=1.0,
                          recall_span=(16, 40), recall_mismatch=0.0).batch(3, 6, 200, seed=1))  # 0: batches as before
    shares = []
    for row, copied in zip(plain.batch(5, 32, 400, seed=3), missed.batch(5, 32, 400, seed=3)):
        changed = np.flatnonzero(row != copied)
        dst = changed[0]  # the copy is the only change (no source rewrite), its first token may be replaced
        src = next(j for j in range(dst) if np.mean(row[j:j + 40] == copied[dst:dst + 40]) > 0.5)
        same = row[src:src + 40] == copied[dst:dst + 40]
        assert changed[-1] < dst + 40 and 0 < same.mean() < 1  # follows its source, except where replaced
        shares.append(1 - same.mean())
    assert 0.15 < np.mean(shares) < 0.35  # about a quarter of each copy replaced


def test_several_recall_spans_per_window_never_overlap():
    docs = [np.arange(1, 30_000, dtype=np.int32)]  # consecutive ids: every copy is a run of +1 steps from elsewhere
    plain = TokenStream(docs, 0).batch(2, 24, 400, seed=4)
    multi = TokenStream(docs, 0, recall_fraction=1.0, recall_span=(10, 20), recall_spans=3, recall_distance=0.1,
                        recall_uniform=True).batch(2, 24, 400, seed=4)
    for row, copied in zip(plain, multi):
        changed = np.flatnonzero(row != copied)
        breaks = np.flatnonzero((np.diff(changed) != 1) | (np.diff(copied[changed]) != 1)) + 1
        runs = np.split(changed, breaks)
        assert len(runs) == 3  # three copies, none overwriting another
        for run in runs:
            dst, n = int(run[0]), len(run)
            src = int(copied[dst] - row[0])  # where the copied ids were in the untouched window
            assert 10 <= n <= 20 and src + 40 <= dst  # at least 10% of the window back
            assert np.array_equal(copied[src:src + n], row[src:src + n])  # its source left as it was
            assert np.array_equal(copied[dst:dst + n], row[src:src + n])


def test_recall_span_bounds_and_config_errors():
    from diffspec_jax.errors import ConfigError
    from diffspec_jax.training import recall_span_of

    rng = np.random.default_rng(0)
    for _ in range(300):
        src, dst, n = recall_span_of(rng, 101, (5, 40))
        assert 5 <= n <= 25 and 0 <= src and src + n <= dst and dst + n <= 101  # capped at a quarter window
    assert recall_span_of(rng, 15, (5, 40)) is None
    dists = []
    for _ in range(300):
        src, dst, n = recall_span_of(rng, 1000, (5, 40), min_distance=0.6)
        assert 5 <= n <= 40 and src >= 0 and dst - src >= 600 and dst + n <= 1000
        dists.append(dst - src)
    assert max(dists) > 900 and min(dists) < 640  # the allowed distances are all drawn
    share_far = {}
    for uniform in (False, True):
        far = []
        for _ in range(600):
            src, dst, n = recall_span_of(rng, 1000, (5, 40), min_distance=0.1, uniform_distance=uniform)
            assert 5 <= n <= 40 and src >= 0 and dst - src >= 100 and dst + n <= 1000
            far.append(dst - src)
        share_far[uniform] = np.mean(np.array(far) >= 800)
    assert share_far[True] > 0.15 > 0.06 > share_far[False]  # uniform distances: far copies as common as near ones
    src, dst, n = recall_span_of(rng, 1000, (250, 250), min_distance=0.75)  # the tightest fit
    assert (src, dst, n) == (0, 750, 250)
    docs = [np.arange(1, 100, dtype=np.int32)]
    for kw in (dict(recall_fraction=1.5), dict(recall_noise=-0.1), dict(recall_span=(0, 4)),
               dict(recall_span=(9, 4)), dict(recall_distance=0.8), dict(recall_distance=-0.1),
               dict(recall_random=0.5), dict(recall_random=1.5, vocab_size=10), dict(recall_random=0.5, vocab_size=1),
               dict(recall_spans=0), dict(recall_spans=1.5)):
        with pytest.raises(ConfigError):
            TokenStream(docs, 0, **kw)


def test_train_target_continues_from_given_params(corpus_stream):
    """A later phase starts from the earlier phase's params, not a fresh init: with the warm-up's zero first
    learning rate, one step returns them unchanged."""
    import jax

    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.models import family

    tok, stream, _ = corpus_stream
    cfg = tiny_config("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    start = family(cfg).init_params(cfg, seed=11, dtype=jnp.float32, scale=0.05)
    kw = dict(steps=1, batch=2, seq_len=32, progress=False, optim=OptimConfig(lr=3e-3, warmup_steps=4,
                                                                              total_steps=8))
    kept, _ = train_target(cfg, stream, params=start, **kw)
    fresh, _ = train_target(cfg, stream, **kw)
    same = jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), kept, start)
    assert all(jax.tree_util.tree_leaves(same))
    assert not np.array_equal(fresh["layers"][0]["wq"], start["layers"][0]["wq"])


def test_loop_rows_repeat_their_period_and_the_penalty_matches_numpy(corpus_stream):
    """LoopWindows: each loop row's tail repeats the period before it; loop_loss against a NumPy loop; and one
    training step carries it (history's loop_loss)."""
    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.errors import ConfigError
    from diffspec_jax.training import LoopWindows, loop_loss

    tok, stream, _ = corpus_stream
    loops = LoopWindows(stream, rows=5, loop_len=96, loop_span=(1, 11), decay=0.5)
    b = loops.batch(4, 2, 40, seed=3)
    assert np.array_equal(b["tokens"], stream.batch(4, 2, 40, seed=3))
    assert all(np.array_equal(v, loops.batch(4, 2, 40, seed=3)[k]) for k, v in b.items())  # (seed, step) decides
    periods = set()
    for row, per in zip(b["loop"], b["period"]):
        t = np.flatnonzero(per)
        n = int(per[t[0]])
        periods.add(n)
        assert 1 <= n <= 11 and t[0] >= 48 and np.array_equal(t, np.arange(t[0], 97)) and set(per[t]) == {n}
        assert np.array_equal(row[t], row[t - n])  # every marked token repeats the one a period earlier
    assert len(periods) > 1
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, 96, len(tok)))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want, count = 0.0, 0
    for r in range(5):
        for i in range(96):  # prediction i is of token i + 1
            n = b["period"][r, i + 1]
            if n and i - n >= 0:
                p_now = np.exp(logp[r, i, b["loop"][r, i + 1]])
                p_then = np.exp(logp[r, i - n, b["loop"][r, i + 1 - n]])
                want += -np.log(max(1 - abs(p_now - 0.5 * p_then), 1e-6))
                count += 1
    got = float(loop_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(b["loop"]), jnp.asarray(b["period"]), 0.5))
    assert count > 0 and got == pytest.approx(want / count, rel=1e-4)
    cfg = tiny_config("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    _, hist = train_target(cfg, stream, steps=2, batch=2, seq_len=32, progress=False, log_every=1,
                           loops=LoopWindows(stream, rows=2, loop_len=64, loop_span=(4, 8)))
    assert all(row["loop_loss"] > 0 for row in hist)
    with pytest.raises(ConfigError, match="loop_span"):
        LoopWindows(stream, loop_len=64, loop_span=(8, 17))
    with pytest.raises(ConfigError, match="the stream being trained on"):
        train_target(cfg, stream, steps=1, batch=1, seq_len=16, progress=False,
                     loops=LoopWindows(TokenStream([np.arange(1, 99, dtype=np.int32)], 0), loop_len=16,
                                       loop_span=(1, 4)))



def test_greedy_unlikelihood_marks_its_own_repeats_and_matches_generate(corpus_stream, trained_target):
    """GreedyUnlikelihood: greedy_continuation equals the library's target-only greedy generate(); repeated_ngrams
    and the penalty against NumPy loops; one training step carries it (history's metrics)."""
    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.errors import ConfigError
    from diffspec_jax.training import (GreedyUnlikelihood, Objectives, greedy_continuation,
                                       greedy_unlikelihood_loss, repeated_ngrams)

    tok, stream, _ = corpus_stream
    model, _ = trained_target
    unl = GreedyUnlikelihood(stream, rows=3, context=24, new_tokens=20)
    prompts = unl.rows_at(5, seed=2)["prompts"]
    assert prompts.shape == (3, 24) and np.array_equal(prompts, unl.rows_at(5, seed=2)["prompts"])
    got = np.asarray(greedy_continuation(model.config, model.params, jnp.asarray(prompts), 20,
                                         compute_dtype=jnp.float32))
    ref = generate(model, None, [list(map(int, r)) for r in prompts], max_new_tokens=20, stop_token_ids=())
    assert got.tolist() == [list(t) for t in ref.tokens]
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 3, (4, 30))  # three symbols: 2-grams and 3-grams repeat often, not always
    for n in (1, 2, 3):
        want = np.array([[i >= n - 1 and any(list(r[i - n + 1:i + 1]) == list(r[j - n + 1:j + 1])
                                             for j in range(n - 1, i)) for i in range(30)] for r in toks])
        mask = np.asarray(repeated_ngrams(jnp.asarray(toks), n))
        assert np.array_equal(mask, want) and 0 < want.mean() < 1
    logits = rng.normal(0, 3, (4, 30, 5))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    rep = np.asarray(repeated_ngrams(jnp.asarray(toks), 2))
    p = np.exp(np.take_along_axis(logp, toks[..., None], -1)[..., 0])
    penalty, share = greedy_unlikelihood_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(toks), 2)
    assert float(penalty) == pytest.approx(-np.log(1 - p[rep]).mean(), rel=1e-4)
    assert float(share) == pytest.approx(rep.mean())
    b = Objectives(stream, unl).batch(5, 2, 40, seed=2)
    assert np.array_equal(b["tokens"], stream.batch(5, 2, 40, seed=2)) and np.array_equal(b["prompts"], prompts)
    cfg = tiny_config("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    _, hist = train_target(cfg, stream, steps=2, batch=2, seq_len=32, progress=False, log_every=1,
                           unlikelihood=GreedyUnlikelihood(stream, rows=2, context=16, new_tokens=24, ngram=2))
    assert all(row["unlikelihood_loss"] > 0 and 0 < row["greedy_repeat_share"] <= 1 for row in hist)
    with pytest.raises(ConfigError, match="ngram"):
        GreedyUnlikelihood(stream, new_tokens=8, ngram=8)


def test_build_curriculum_option():
    import argparse

    from diffspec_jax.demo.build import parse_curriculum

    assert parse_curriculum("512:32:10000,2048:8:2000") == ((512, 32, 10000), (2048, 8, 2000))
    assert parse_curriculum("") == ()
    for bad in ("512:32", "512:0:10", "a:b:c", "512:32:10:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="SEQ_LEN:BATCH:STEPS"):
            parse_curriculum(bad)


def test_build_init_target_loads_an_earlier_build(tmp_path, tiny_dirs):
    """--init-target: the committed demo target's weights (read here with safetensors, in the training layout),
    its tokenizer and provenance; clear errors for a directory without a tokenizer, a checkpoint of another shape,
    a directory the build would clear, and bad corpus / recall settings (before anything is cleared)."""
    import hashlib
    import shutil

    from safetensors.numpy import load_file

    from diffspec_jax import demo
    from diffspec_jax.demo.build import initial_target, main
    from diffspec_jax.errors import CheckpointError, ConfigError
    from diffspec_jax.models import family

    tok, params, entry = initial_target(demo.target_dir())
    card = json.loads((demo.PAIR / "model_card.json").read_text())
    cfg = load_target(demo.target_dir()).config
    assert len(tok) == cfg.vocab_size and tok.eos_token_id == cfg.eos_token_ids[0]
    layout = family(cfg).init_params(cfg, seed=0, dtype=jnp.float32)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(layout)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    tensors = {}
    for f in sorted(demo.target_dir().glob("*.safetensors")):
        tensors.update(load_file(f))
        assert entry["sha256"][f.name] == hashlib.sha256(f.read_bytes()).hexdigest()
    np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"].astype(np.float32))
    wq = np.asarray(params["layers"][3]["wq"])
    np.testing.assert_array_equal(
        wq, tensors["model.layers.3.self_attn.q_proj.weight"].astype(np.float32).T.reshape(wq.shape))
    assert entry["trained_by"]["steps"] == card["target"]["steps"] + sum(
        p["steps"] for p in card["target"].get("curriculum", []))

    bare = tmp_path / "bare"
    shutil.copytree(demo.target_dir(), bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is listed in diffspec_manifest.json but missing"):
        initial_target(bare)
    (bare / "diffspec_manifest.json").unlink()  # a deliberate edit drops the manifest too
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        initial_target(bare)
    other = tmp_path / "other"
    shutil.copytree(tiny_dirs["llama"], other)
    shutil.copy(demo.target_dir() / "tokenizer.json", other)
    shutil.copy(demo.target_dir() / "tokenizer_config.json", other)
    with pytest.raises(ConfigError, match="vocab_size"):
        initial_target(other)
    inside = tmp_path / "out" / "target"
    shutil.copytree(demo.target_dir(), inside)
    with pytest.raises(ConfigError, match="inside --out"):
        main(["--out", str(tmp_path / "out"), "--init-target", str(inside)])
    with pytest.raises(ConfigError, match="inside --out"):
        main(["--out", str(inside), "--init-target", str(inside)])
    assert (inside / "config.json").is_file()
    for bad, match in ((["--recall-distance", "0.9"], "recall_distance"), (["--dedup-lines", "1.5"], "threshold"),
                       (["--recall-fraction", "2"], "recall_fraction"), (["--recall-mismatch", "1"], "recall_mismatch"),
                       (["--target-steps", "0"], "give --init-target"),
                       (["--target-steps", "0", "--init-target", str(bare), "--curriculum", "64:2:2"],
                        "no --curriculum"),
                       (["--target-steps", "-1"], "target-steps"),
                       (["--draft-aux-layers", "0,3,6"], "draft-aux-layers entry")):
        with pytest.raises(ConfigError, match=match):  # refused before --out is cleared
            main(["--out", str(tmp_path / "out")] + bad)
        assert (inside / "config.json").is_file()
