"""``python -m diffspec_jax.generate`` and the callable ``diffspec_jax.generate``."""

import json
import subprocess
import sys

import numpy as np
import pytest

from diffspec_jax import forward, load_target


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
    seq = list(rep["prompt_ids"])
    for _ in range(12):  # independent reference: recompute the whole sequence per token, no cache
        seq.append(int(np.argmax(np.asarray(forward(model, [seq]))[0, -1])))
    assert seq[len(rep["prompt_ids"]):] == rep["ids"]


def test_compare_policy_flags_and_summary(random_pair, capsys):
    target, draft = random_pair
    code, out = run_cli(["--target", str(target), "--draft", str(draft), "--max-new-tokens", "16", "--compare",
                         "--policy", "diffspec", "--token-budget", "32", "--chunk-size", "8",
                         "--retrieval-interval", "2", "--prompt-ids", ",".join(str(i) for i in range(3, 60)),
                         "--ignore-eos", "--no-progress", "--dtype", "float32"], capsys)
    assert code == 0
    assert "identical output: True" in out.err and "retrievals" in out.err and "RANDOM" in out.err
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
    code, out = run_cli(["--target", str(target), "--prompt-ids", "1,2", "--tree-branching", "bushy"], capsys)
    assert code == 2 and "diffspec_tree_branching" in out.err


def test_embedded_demo_pair_with_a_text_prompt(capsys):
    """No --target: the shipped trained pair, its tokenizer, DiffSpec, and the comparison with target-only."""
    code, out = run_cli(["--prompt", "import os\n\ndef main(argv):\n    parser = ", "--max-new-tokens", "24",
                         "--json", "--ignore-eos"], capsys)
    assert code == 0, out.err
    rep = json.loads(out.out)
    assert rep["random_weights"] is False and rep["target"].endswith("demo/pair/target")
    assert rep["stats"]["draft_context_policy"] == "diffspec" and len(rep["ids"]) == 24
    assert rep["identical_to_target_only"] is True and rep["decode_speedup"] > 0
    assert isinstance(rep["text"], str) and rep["text"]
    assert rep["stats"]["mean_acceptance_length"] > 1.0  # a trained draft gets tokens accepted


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
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    code, out = run_cli(["--prompt-file", "-"] + args, capsys)
    assert code == 0, out.err
    assert json.loads(out.out)["ids"] == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"  \n")))
    code, out = run_cli(["--prompt-file", "-"] + args, capsys)
    assert code == 2 and "empty prompt from standard input" in out.err and "Traceback" not in out.err
    code, out = run_cli(["--draft", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2 and "--draft needs --target" in out.err
