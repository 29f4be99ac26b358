"""``python -m diffspec_jax.generate`` and the callable ``diffspec_jax.generate``."""

import json
import subprocess
import sys

import numpy as np
import pytest

from diffspec_jax import forward, load_target
from diffspec_jax.errors import InputError


def run_cli(args, capsys):
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")  # the CLI module (also callable)
    code = cli.main(args)
    return code, capsys.readouterr()


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny, make_tiny_draft, tiny_config

    root = tmp_path_factory.mktemp("cli")
    return make_tiny(root / "t", "llama", seed=0), make_tiny_draft(root / "d", tiny_config("llama"), seed=1)


def test_random_checkpoint_is_labelled_and_matches_full_forward_greedy(random_pair, capsys):
    target, draft = random_pair
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7,8,9,10",
                         "--max-new-tokens", "12", "--json", "--ignore-eos", "--dtype", "float32"], capsys)
    assert code == 0
    rep = json.loads(out.out)
    assert rep["random_weights"] is True and rep["draft"] and len(rep["ids"]) == 12
    assert rep["stats"]["num_speculative_tokens"] == 4
    model = load_target(rep["target"], dtype="float32")
    n = len(rep["prompt_ids"])
    # independent reference: one causal forward of the whole sequence, no cache; each token is the argmax after
    # the ones before it
    logits = np.asarray(forward(model, [list(rep["prompt_ids"]) + rep["ids"]]))[0]
    assert [int(t) for t in np.argmax(logits[n - 1:n + 11], axis=-1)] == rep["ids"]


def test_compare_policy_flags_and_summary(random_pair, capsys):
    target, draft = random_pair
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--max-new-tokens", "16", "--compare",
                         "--policy", "diffspec", "--token-budget", "32", "--chunk-size", "8",
                         "--retrieval-interval", "2", "--prompt-ids", ",".join(str(i) for i in range(3, 60)),
                         "--ignore-eos", "--no-progress", "--dtype", "float32"], capsys)
    assert code == 0
    assert "output identical to target-only" in out.err and "retrievals" in out.err and "RANDOM" in out.err
    assert "speedup over target-only: decode " in out.err and " end to end " in out.err
    assert len(out.out.split()) == 16  # streamed ids


def test_tree_mode_flags(random_pair, capsys):
    target, draft = random_pair
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7,8,9,10,11",
                         "--max-new-tokens", "10", "--ignore-eos", "--dtype", "float32", "-k", "3",
                         "--verification-mode", "tree", "--max-tree-nodes", "7", "--tree-topk", "2",
                         "--tree-branching", "uniform1", "--adaptive", "--json"], capsys)
    assert code == 0, out.err
    s = json.loads(out.out)["stats"]
    # one child per node: the tree is a chain of K = 3 nodes, under the budget of round4(7 / 1.5) = 4
    assert s["verification_mode"] == "tree" and s["mean_tree_size"] == 3
    assert s["drafting"]["per_sequence"][0]["branching"]["caps"] == [1, 1, 1]
    code, out = run_cli(["--target", str(target), "--prompt-ids", "1,2", "--verification-mode", "tree",
                         "--tree-branching", "bushy"], capsys)
    assert code == 2 and "diffspec_tree_branching" in out.err


def test_embedded_demo_pair_with_a_text_prompt(capsys):
    """No --target: the shipped trained pair, its tokenizer, DiffSpec, and the comparison with target-only (both
    speedups, each run's prefill, a reason when one is below 1); --no-compare runs the speculative path alone."""
    args = ["--prompt", "import os\n\ndef main(argv):\n    parser = ", "--max-new-tokens", "24", "--ignore-eos"]
    code, out = run_cli(args + ["--json"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["random_weights"] is False and rep["target"].endswith("demo/pair/target")
    assert rep["stats"]["draft_context_policy"] == "diffspec" and len(rep["ids"]) == 24
    assert rep["identical_to_target_only"] is True and rep["decode_speedup"] > 0 and rep["end_to_end_speedup"] > 0
    assert rep["baseline"]["prefill_s"] > 0 and rep["warmup_s"] > 0
    assert (rep["speedup_note"] is None) == (min(rep["decode_speedup"], rep["end_to_end_speedup"]) >= 1)
    assert isinstance(rep["text"], str) and rep["text"]
    assert rep["stats"]["mean_acceptance_length"] > 1.0  # a trained draft gets tokens accepted
    code, out = run_cli(args + ["--no-compare"], capsys)  # compiled above: one more short run
    assert code == 0, out.err
    assert "speculative decoding, policy diffspec]" in out.err and "speculative: new tokens 24" in out.err
    assert "target-only" not in out.err and "speedup" not in out.err and "warm-up" not in out.err


def test_example_recall_compares_both_policies_on_a_far_passage(monkeypatch, capsys):
    """--example recall (issue 43), shortened: the prompt re-emits its file's opening at the end, further back than
    the working cache holds; both policies' acceptance, DiffSpec's retrievals and losslessness are reported."""
    cli = _cli()
    monkeypatch.setattr(cli, "RECALL_CONTEXT", 1024)
    monkeypatch.setattr(cli, "RECALL_BUDGET", 256)
    prompt = cli.demo.recall_prompt(cli._tokenizer(cli.default_pair()[0]), 1024, cli.RECALL_PASSAGE, 12)
    assert len(prompt.ids) == 1024 and prompt.ids[-cli.RECALL_PASSAGE:] == prompt.ids[:cli.RECALL_PASSAGE]
    assert prompt.distance == 1024 and len(prompt.reference) == 12
    code, out = run_cli(["--example", "recall", "--max-new-tokens", "12", "--json"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["prompt_tokens"] == 1024 and rep["passage_distance"] == 1024 > rep["token_budget"] == 256
    assert rep["greedy"] is True and len(rep["ids"]) == 12 and 0.0 <= rep["copied_fraction"] <= 1.0
    diffspec, recent = rep["policies"]["diffspec"], rep["policies"]["recent"]
    assert diffspec["retrieval"]["retrievals"] >= 1 and recent["retrieval"] is None
    for run in (diffspec, recent):
        assert run["mean_acceptance_length"] >= 1.0 and run["identical_to_target_only"] is True
    lines = cli.recall_summary_lines(rep)
    assert lines[1].startswith("diffspec: mean acceptance length") and "retrievals " in lines[1]
    assert lines[2].startswith("recent: mean acceptance length") and "no retrieval" in lines[2]
    assert "output identical to target-only (greedy: lossless)" in lines[1] and lines[3].startswith("diffspec - recent")


def test_example_conflicts_are_usage_errors(capsys):
    """--example brings its own prompt, pair, policies and greedy decoding: options that set them exit 2 in one line
    naming them, before anything is loaded; an unknown example is refused by the parser."""
    for args, named in [(["--prompt", "x"], "--prompt"), (["--prompt-ids", "1,2"], "--prompt-ids"),
                        (["--policy", "recent"], "--policy"), (["--target", "/nonexistent"], "--target"),
                        (["--draft", "self"], "--draft"),
                        (["--prompt-file", "p.txt", "--temperature", "0.7"], "--prompt-file, --temperature")]:
        code, out = run_cli(["--example", "recall", *args], capsys)
        assert code == 2 and f"cannot be combined with {named};" in out.err and "--example recall" in out.err, args
        assert "Traceback" not in out.err and len([ln for ln in out.err.splitlines() if ln.strip()]) == 1
    with pytest.raises(SystemExit) as exc:
        run_cli(["--example", "bogus"], capsys)
    assert exc.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(random_pair, tmp_path, capsys):
    target, _ = random_pair
    code, out = run_cli(["--target", str(target), "--prompt-ids", "1,2,99999"], capsys)
    assert code == 2 and "must lie in [0, 256)" in out.err
    code, out = run_cli(["--target", str(target), "--prompt", "hello"], capsys)
    assert code == 2 and "has no tokenizer; pass --prompt-ids" in out.err
    code, out = run_cli(["--num-speculative-tokens", "0", "--prompt", "x"], capsys)
    assert code == 2 and "num_speculative_tokens must be a positive integer" in out.err
    code, out = run_cli(["--target", str(tmp_path / "missing")], capsys)
    assert code == 2 and "does not exist" in out.err


def test_package_generate_stays_callable_after_the_cli_module_is_imported(targets):
    import diffspec_jax.generate  # noqa: F401  (rebinds the package attribute to the module)

    res = diffspec_jax.generate(targets["llama"], None, [[5, 6, 7]], max_new_tokens=3, stop_token_ids=())
    assert len(res.tokens[0]) == 3


def test_module_runs_as_a_script(random_pair):
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "diffspec_jax.generate", "--target", str(random_pair[0]),
                           "--prompt-ids", "4,5,6", "--max-new-tokens", "4", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["ids"]) <= 4
    assert "RuntimeWarning" not in proc.stderr


def test_text_prompt_chat_template_and_streamed_text(tmp_path, capsys):
    """A target directory with a tokenizer: text in, text out, chat template applied with --chat."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from checkpoints_tools.make_tiny import make_tiny, make_tiny_draft, tiny_config

    target = make_tiny(tmp_path / "t", "llama", seed=2)
    draft = make_tiny_draft(tmp_path / "d", tiny_config("llama"), seed=3)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}"
    fast.save_pretrained(target)
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--prompt", "w1 w2 w3 w4", "--chat",
                         "--max-new-tokens", "6", "--ignore-eos", "--json", "--dtype", "float32"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["prompt_ids"] == [10, 4, 5, 6, 7, 11] and rep["random_weights"] is True  # make_tiny weights
    assert rep["text"] == " ".join(words[i] for i in rep["ids"])
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--prompt", "w1 w2", "--max-new-tokens",
                         "5", "--ignore-eos", "--dtype", "float32", "--no-progress"], capsys)
    assert code == 0 and len(out.out.split()) == 5 and all(w.startswith("w") for w in out.out.split())


def test_auto_dtype_is_float32_on_the_cpu():
    from diffspec_jax.generate import resolve_dtype_arg

    assert resolve_dtype_arg("auto") == "float32"  # the suite runs on the CPU (conftest)
    assert resolve_dtype_arg("bfloat16") == "bfloat16"


def test_divergence_reports_the_targets_logit_gap(random_pair, capsys, monkeypatch):
    """--compare explains a greedy mismatch by the target's own logit gap at the first differing token (a near-tie
    or not), and a mismatch that is not a near-tie fails the command."""
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")
    target_dir, draft = random_pair
    model = load_target(target_dir, dtype="float32")
    prompt = [5, 6, 7, 8, 9, 10]
    base = list(prompt)
    for _ in range(6):
        base.append(int(np.argmax(np.asarray(forward(model, [base]))[0, -1])))
    base = base[len(prompt):]
    logits = np.asarray(forward(model, [prompt + base[:3]]))[0, -1].astype(np.float64)
    runner_up = int(np.argsort(logits)[-2])
    ours = base[:3] + [runner_up] + base[4:]
    div = cli.divergence(model, prompt, base, ours)
    assert div["new_token"] == 3 and div["target_only"] == base[3] and div["speculative"] == runner_up
    assert div["logit_gap"] == pytest.approx(logits[base[3]] - logits[runner_up], abs=1e-4)
    assert div["near_tie"] == (div["logit_gap"] <= cli.NEAR_TIE_LOGIT_GAP)
    assert cli.divergence(model, prompt, base, list(base)) is None
    # through the CLI: a speculative run that emits a wrong token is reported and fails (exit 1)
    real_generate = cli.engine.generate

    def corrupt(target, draft_model, prompts, **kw):
        res = real_generate(target, draft_model, prompts, **kw)
        if draft_model is not None:
            res.tokens[0][2] = (res.tokens[0][2] + 7) % model.config.vocab_size
        return res

    monkeypatch.setattr(cli.engine, "generate", corrupt)
    code, out = run_cli(["--target", str(target_dir), "--draft", str(draft), "--prompt-ids", "5,6,7,8,9,10",
                         "--max-new-tokens", "6", "--ignore-eos", "--compare", "--no-progress", "--dtype", "float32"],
                        capsys)
    assert "first divergence at new token 2" in out.err
    assert code == (0 if "near-tie, not" in out.err else 1)


def test_prompt_from_standard_input_and_draft_without_target(monkeypatch, capsys, tmp_path):
    """--prompt-file - reads the prompt from stdin (the same ids as --prompt with that text); empty stdin and
    --draft without --target are usage errors."""
    import io

    text = "import os\n\ndef main(argv):\n    parser = "
    args = ["--max-new-tokens", "4", "--no-draft", "--json", "--ignore-eos"]
    code, out = run_cli(["--prompt", text] + args, capsys)
    assert code == 0, out.err
    want = json.loads(out.out)["ids"]
    code, out = run_cli(["--prompt", text, "--max-new-tokens", "4", "--no-draft", "--ignore-eos", "--no-progress"],
                        capsys)  # what --no-draft prints (compiled above)
    assert code == 0, out.err
    assert "target-only decoding (--no-draft): no draft, no comparison]" in out.err and "policy" not in out.err
    assert "target-only: new tokens 4" in out.err and "speedup" not in out.err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    code, out = run_cli(["--prompt-file", "-"] + args, capsys)
    assert code == 0, out.err
    assert json.loads(out.out)["ids"] == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"  \n")))
    code, out = run_cli(["--prompt-file", "-"] + args, capsys)
    assert code == 2 and "empty prompt from standard input" in out.err and "Traceback" not in out.err
    code, out = run_cli(["--draft", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2 and "--draft needs --target" in out.err


# ------------------------------------------------------------------ EOS from generation_config.json, stop strings
NEW = 24


def train_byte_bpe(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained offline (256 byte tokens, merges, <|endoftext|> = 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["def main(argv):\n    return 0\n", "print('世界 🎉 ça va')\n", "x = [1, 2, 3]  # 日本語\n"] * 20
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    """A tiny Llama built by transformers with a byte-level BPE tokenizer of its vocabulary, a random draft, a
    prompt and the target-only greedy continuation (NEW tokens, no stop id) as the reference."""
    from types import SimpleNamespace

    from checkpoints_tools.make_tiny import make_tiny, make_tiny_draft
    from diffspec_jax import engine

    root = tmp_path_factory.mktemp("bpe")
    tok = train_byte_bpe()
    # scale 0.3: a random model whose greedy text varies (multi-byte characters, merges, control bytes)
    target_dir = make_tiny(root / "t", "llama", backend="transformers", seed=2, scale=0.3, vocab_size=len(tok),
                           bos_token_id=0, eos_token_ids=(0,))
    tok.save_pretrained(target_dir)
    model = load_target(target_dir, dtype="float32")
    draft_dir = make_tiny_draft(root / "d", model.config, seed=3)
    prompt = tok("def main(argv):\n")["input_ids"]
    greedy = engine.generate(model, None, [prompt], max_new_tokens=NEW, stop_token_ids=()).tokens[0]
    assert len(set(greedy)) > NEW // 2  # a varied reference
    return SimpleNamespace(tok=tok, target=target_dir, draft=draft_dir, model=model, prompt=prompt, greedy=greedy,
                           args=["--draft", str(draft_dir), "--prompt", "def main(argv):\n", "--max-new-tokens",
                                 str(NEW), "--dtype", "float32"])


def fewest_tokens(tok, ids, text):
    """The fewest leading ids whose decoding begins with ``text`` (the rule for tokens cut at a stop string)."""
    return next(n for n in range(len(ids) + 1) if tok.decode(ids[:n], skip_special_tokens=True).startswith(text))


def test_generation_config_eos_stops_with_finish_reason_stop(bpe_pair, tmp_path, capsys):
    import shutil

    g = bpe_pair.greedy
    j = next(i for i in range(2, NEW - 2) if g[i] not in g[:i])  # a token the model emits, first at position j
    assert 0 not in g[:j + 1]  # config.json's own EOS (0) comes no earlier
    target = shutil.copytree(bpe_pair.target, tmp_path / "t")
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [g[j], 0]}))
    code, out = run_cli(["--target", str(target), *bpe_pair.args, "--json"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["ids"] == g[:j + 1] and rep["finish_reason"] == "stop"
    assert rep["text"] == bpe_pair.tok.decode(g[:j + 1], skip_special_tokens=True)
    code, out = run_cli(["--target", str(target), *bpe_pair.args, "--json", "--ignore-eos"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["ids"] == g and rep["finish_reason"] == "length"


def pick_stop(text: str) -> str:
    """A two-character stop string from the middle of ``text`` with no U+FFFD."""
    for p in range(len(text) // 3, len(text) - 2):
        s = text[p:p + 2]
        if "\ufffd" not in s and text.find(s) >= 2:
            return s
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_strings_cut_the_output_exactly_and_stream_it(bpe_pair, capsys):
    tok, g = bpe_pair.tok, bpe_pair.greedy
    full = tok.decode(g, skip_special_tokens=True)
    stop = pick_stop(full)
    want = full[:full.find(stop)]  # cut by hand
    args = ["--target", str(bpe_pair.target), *bpe_pair.args, "--ignore-eos", "--stop", stop, "--stop", "\ue000!"]
    code, out = run_cli(args + ["--json"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["text"] == want and rep["finish_reason"] == "stop" and rep["stop"] == [stop, "\ue000!"]
    assert rep["ids"] == g[:fewest_tokens(tok, g, want)]
    # streamed: stdout is the text byte for byte (then a newline); progress and statistics on stderr
    code, out = run_cli(args, capsys)
    assert code == 0, out.err
    assert out.out.encode() == (want + "\n").encode()
    assert "finish reason stop" in out.err and "time to first token" in out.err and "compilation" in out.err
    # stderr is no terminal here: the progress bar's last state stays, and the statistics begin a line of their own
    assert "tok/s]" in out.err
    assert [ln[:24] for ln in out.err.split("\n") if "new tokens" in ln] == ["speculative: new tokens "]


def test_library_stop_strings_texts_and_streams(bpe_pair):
    """generate(stop=, tokenizer=): per prompt, texts cut exactly, tokens cut by the rule, finish reasons, and the
    on_tokens / on_text pieces adding up to them; sequences a stop string ends stop costing device cycles."""
    from diffspec_jax import engine

    tok, model = bpe_pair.tok, bpe_pair.model
    prompts = [bpe_pair.prompt, tok("x = [1, 2")["input_ids"], tok("print('")["input_ids"]]
    ref = engine.generate(model, None, prompts, max_new_tokens=NEW, stop_token_ids=()).tokens
    texts = [tok.decode(r, skip_special_tokens=True) for r in ref]
    # a stop string that occurs early in the first text only: the others run to the length
    stop = next(texts[0][p:p + 3] for p in range(1, len(texts[0]) // 3) if "\ufffd" not in texts[0][p:p + 3]
                and texts[0][p:p + 3] not in texts[1] + texts[2])
    ids_seen, text_seen = [[], [], []], ["", "", ""]
    res = engine.generate(model, None, prompts, max_new_tokens=NEW, stop_token_ids=(), stop=stop, tokenizer=tok,
                          block_cycles=4,
                          on_tokens=lambda i, t: ids_seen[i].extend(t),
                          on_text=lambda i, t: text_seen.__setitem__(i, text_seen[i] + t))
    want = texts[0][:texts[0].find(stop)]
    assert res.texts == [want, texts[1], texts[2]] == text_seen
    assert res.tokens == [ref[0][:fewest_tokens(tok, ref[0], want)], ref[1], ref[2]] == ids_seen
    assert res.finish_reasons == ["stop", "length", "length"]
    # sequence 0 ends in an early block of 4 cycles: after the block in flight, the device no longer runs it (3
    # rows, 2 live: too many to compact)
    assert res.stats.sequence_cycles < 3 * (NEW - 1)
    with pytest.raises(InputError, match="pass the target's tokenizer"):
        engine.generate(model, None, prompts[:1], max_new_tokens=2, stop=["x"])
    with pytest.raises(InputError, match="empty string"):
        engine.generate(model, None, prompts[:1], max_new_tokens=2, stop=[""], tokenizer=tok)


def test_status_line_instead_of_a_bar_on_one_terminal(bpe_pair, capsys, monkeypatch):
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")
    monkeypatch.setattr(cli, "same_terminal", lambda *a: True)
    code, out = run_cli(["--target", str(bpe_pair.target), *bpe_pair.args, "--ignore-eos"], capsys)
    assert code == 0, out.err
    assert out.out == bpe_pair.tok.decode(bpe_pair.greedy, skip_special_tokens=True) + "\n"  # nothing else
    status = out.err.index("[prefill of")
    assert status < out.err.index("first token after") < out.err.index("new tokens")
    assert "tok/s]" not in out.err  # no tqdm bar


def test_same_terminal_detection(tmp_path):
    import os
    import pty

    from diffspec_jax.generate import same_terminal

    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as a, open(slave, "w", closefd=False) as b, \
                open(tmp_path / "f", "w") as f:
            assert same_terminal(a, b) and not same_terminal(f, b) and not same_terminal(object(), b)
    finally:
        os.close(master)
        os.close(slave)


def test_sampling_defaults_from_generation_config(bpe_pair, tmp_path):
    import importlib
    import shutil

    cli = importlib.import_module("diffspec_jax.generate")
    target = shutil.copytree(bpe_pair.target, tmp_path / "t")
    (target / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7,
                                                               "top_k": 20}))
    parse = cli.build_parser().parse_args
    got, _ = cli._sampling(parse(["--target", str(target)]), target)
    assert (got.temperature, got.top_k, got.top_p) == (0.7, 20, 1.0)
    got, _ = cli._sampling(parse(["--target", str(target), "--top-k", "0", "--top-p", "0.5"]), target)
    assert (got.temperature, got.top_k, got.top_p) == (0.7, 0, 0.5)
    assert cli._sampling(parse(["--temperature", "0"]), target)[0].greedy
    assert cli._sampling(parse([]), bpe_pair.draft)[0] == cli.SamplingConfig()  # no generation_config.json


@pytest.mark.parametrize("args, needle", [
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", " , "], "--prompt-ids is empty"),
    (["--prompt-ids", "1,,2"], "empty entry"),
    (["--prompt-ids", "1,a"], "comma-separated integers, got 'a'"),
    (["--prompt-ids", "1,2", "--stop", "x"], "no tokenizer"),
])
def test_usage_errors_exit_2_without_a_traceback(random_pair, capsys, args, needle):
    code, out = run_cli(["--target", str(random_pair[0]), *args], capsys)
    assert code == 2 and needle in out.err and "Traceback" not in out.err
    assert len(out.err.strip().splitlines()) == 1


def test_empty_stop_string_is_a_usage_error(bpe_pair, capsys):
    code, out = run_cli(["--target", str(bpe_pair.target), "--prompt", "x", "--stop", ""], capsys)
    assert code == 2 and "--stop[0] is an empty string" in out.err and "Traceback" not in out.err


def test_prompt_size_cap_fails_fast_without_loading_a_model(tmp_path, monkeypatch, capsys):
    """--prompt-file (or standard input) larger than --max-prompt-bytes is a usage error after reading that many
    bytes: /dev/zero fails at once, before any checkpoint is loaded (issue 38)."""
    import io
    import time

    from diffspec_jax.generate import MAX_PROMPT_BYTES

    t0 = time.perf_counter()
    code, out = run_cli(["--prompt-file", "/dev/zero", "--target", str(tmp_path / "absent")], capsys)
    assert code == 2 and f"holds more than {MAX_PROMPT_BYTES} bytes" in out.err and "--max-prompt-bytes" in out.err
    assert "Traceback" not in out.err and time.perf_counter() - t0 < 5
    (tmp_path / "p.txt").write_text("12345")
    code, out = run_cli(["--prompt-file", str(tmp_path / "p.txt"), "--max-prompt-bytes", "4"], capsys)
    assert code == 2 and "p.txt holds more than 4 bytes" in out.err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * 5)))
    code, out = run_cli(["--prompt-file", "-", "--max-prompt-bytes", "4"], capsys)
    assert code == 2 and "standard input holds more than 4 bytes" in out.err


@pytest.mark.parametrize("args, needle", [
    (["--draft", "self", "--no-draft"], "--no-draft decodes with the target alone, so --draft would have no effect"),
    (["--draft-tp", "3", "--tp", "1"], "--draft-tp must be 1 (a replicated draft) or equal to --tp"),
    (["--draft-tp", "2", "--tp", "4"], "--tp is 4), got 2"),
    (["--no-draft", "--draft-tp", "1"], "--draft-tp would have no effect"),
    (["--no-draft", "-k", "3", "--policy", "full", "--compare"], "--compare, --num-speculative-tokens, --policy"),
    (["--max-tree-nodes", "8"], "--max-tree-nodes shapes tree verification, but --verification-mode is auto"),
    (["--verification-mode", "linear", "--tree-topk", "2", "--tree-branching", "full"],
     "--tree-topk, --tree-branching"),
    (["--chat", "--prompt-ids", "1,2"], "--chat wraps prompt text"),
])
def test_contradictory_options_are_usage_errors(args, needle, capsys):
    """Options that contradict each other, or that the others make ineffective, exit 2 before anything is loaded."""
    code, out = run_cli(args + ["--target", "/nonexistent"], capsys)
    assert code == 2 and needle in out.err and "Traceback" not in out.err
    assert len([ln for ln in out.err.splitlines() if ln.strip()]) == 1


# ------------------------------------------------------------------ the summary: speedups, their reasons, the banner
def _stats(new_tokens=64, prefill_s=1.0, decode_s=1.0, k=4, acceptance=2.5):
    return {"new_tokens": new_tokens, "prefill_s": prefill_s, "decode_s": decode_s, "ttft_s": prefill_s,
            "decode_tokens_per_s": (new_tokens - 1) / decode_s if decode_s else None, "compile_s": 0.0,
            "num_speculative_tokens": k, "draft_context_policy": "diffspec" if k else None, "sequence_cycles": 9,
            "mean_acceptance_length": acceptance if k else None, "acceptance_per_position": [5, 3, 2, 1]}


def _cli():
    import importlib

    return importlib.import_module("diffspec_jax.generate")  # the CLI module (the package attribute may be the function)


def _compared(ours, base, greedy=True, identical=True, context=10_000, budget=2048):
    cli = _cli()
    report = {"stats": ours, "baseline": base, "finish_reason": "length", "greedy": greedy,
              "identical_to_target_only": identical, "compile_s": 3.0, "warmup_s": 20.0, **cli.speedups(ours, base)}
    report["speedup_note"] = cli.speedup_note(report, context=context, budget=budget)
    return report, "\n".join(cli.summary_lines(report))


def test_summary_labels_both_speedups_with_each_runs_prefill():
    """The issue-39 figures: prefill 15.2 s in both runs, decode 2.5 s against 6.3 s: decode 2.52x, end to end
    1.22x, each labelled, each run's prefill printed, the warm-up runs named; no excuse line above 1."""
    report, text = _compared(_stats(128, 15.2, 2.5), _stats(128, 15.2, 6.3, k=0))
    assert report["decode_speedup"] == pytest.approx(6.3 / 2.5)
    assert report["end_to_end_speedup"] == pytest.approx(21.5 / 17.7)
    assert "speedup over target-only: decode 2.52x (decode time alone), end to end 1.21x (prefill + decode)" in text
    lines = text.splitlines()
    assert lines[0].startswith("speculative: new tokens 128") and "prefill 15.200s" in lines[0]
    assert "in the two warm-up runs" in lines[0] and "--no-compare skips them" in lines[0]
    assert any(ln.startswith("target-only: new tokens 128") and "prefill 15.200s, decode 6.300s" in ln
               for ln in lines)
    assert report["speedup_note"] is None and "why below 1x" not in text
    assert "output identical to target-only (greedy decoding: lossless)" in text


@pytest.mark.parametrize("ours, base, context, needles", [  # (new tokens, prefill s, decode s)
    ((32, 0.01, 0.2), (32, 0.01, 0.1), 40, ["the context (40 tokens) is under the working-cache budget (2048"]),
    ((32, 1.0, 0.2, 1.2), (32, 1.0, 0.1), 9000, ["low acceptance (1.20 tokens per verification"]),
    ((32, 1.0, 0.2, 1.2), (32, 1.0, 0.1), 100, ["low acceptance", "under the working-cache budget"]),
    ((4, 5.0, 0.05), (4, 1.0, 0.06), 9000, ["decoding was faster, but the speculative prefill"]),
    ((32, 1.0, 0.2, 2.0), (32, 1.0, 0.1), 9000, ["cost more than the accepted tokens saved"]),
])
def test_a_speedup_below_one_is_explained_in_one_line(ours, base, context, needles):
    report, text = _compared(_stats(*ours[:3], acceptance=(ours[3:] or (3.0,))[0]), _stats(*base, k=0),
                             context=context)
    assert min(report["decode_speedup"], report["end_to_end_speedup"]) < 1
    notes = [ln for ln in text.splitlines() if ln.startswith("why below 1x: ")]
    assert len(notes) == 1 and all(n in notes[0] for n in needles), notes


def test_sampling_explains_differing_output_and_greedy_does_not():
    _, text = _compared(_stats(), _stats(k=0), greedy=False, identical=False)
    assert "output differs from target-only, as expected when sampling" in text
    assert "identical" not in text and "False" not in text
    _, text = _compared(_stats(), _stats(k=0), greedy=True, identical=False)
    assert "output differs from target-only\n" in text + "\n" and "expected" not in text


def test_demo_banner_and_when_to_compare():
    cli = _cli()
    pair = cli.demo.PAIR
    target_only = cli.demo_banner(pair, 10, None)
    assert "target-only decoding (--no-draft): no draft, no comparison" in target_only and "policy" not in target_only
    assert "policy diffspec; then target-only decoding for the comparison" in cli.demo_banner(pair, 10, "diffspec",
                                                                                               compare=True)
    assert "comparison" not in cli.demo_banner(pair, 10, "recent", compare=False)
    parse = cli.build_parser().parse_args
    assert cli.compare_wanted(parse([]), embedded=True)
    assert not cli.compare_wanted(parse(["--no-compare"]), embedded=True)
    assert not cli.compare_wanted(parse(["--no-draft"]), embedded=True)
    assert not cli.compare_wanted(parse([]), embedded=False) and cli.compare_wanted(parse(["--compare"]), False)
    with pytest.raises(SystemExit):
        parse(["--compare", "--no-compare"])
