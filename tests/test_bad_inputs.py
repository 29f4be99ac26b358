"""Issue 26: every bad input is a named error whose message says what to fix, and the CLIs print one line (exit 2
for usage errors, 1 for others), never a traceback."""

import importlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax import SamplingConfig, SpecConfig, Tree, generate, load_draft, load_target
from diffspec_jax.config import GREEDY_TEMPERATURE, DraftConfig, ModelConfig, RopeConfig
from diffspec_jax.errors import (CheckpointError, ConfigError, DiffspecError, InputError, IntegrityError,
                                 OutputDirError, PathNotFoundError, exit_code)
from diffspec_jax.validation import check_generate_args

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 10000.0}
DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 1}


def one_line_error(err: str) -> str:
    """The CLI's stderr holds exactly one line, and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def gen_cli(args, capsys):
    cli = importlib.import_module("diffspec_jax.generate")
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    return code, capsys.readouterr()


# ----------------------------------------------------------------------------------------- error classes
def test_exit_codes_of_the_error_classes():
    assert exit_code(ConfigError("x")) == exit_code(InputError("x")) == exit_code(OutputDirError("x")) == 2
    assert exit_code(PathNotFoundError("x")) == 2  # a path the user typed
    assert exit_code(CheckpointError("x")) == exit_code(IntegrityError("x")) == exit_code(OSError("x")) == 1
    assert issubclass(IntegrityError, CheckpointError) and issubclass(OutputDirError, ConfigError)


# ----------------------------------------------------------------------------------------- target config.json
def test_target_config_that_is_a_json_list(tmp_path, tiny_dirs):
    d = tmp_path / "t"
    shutil.copytree(tiny_dirs["llama"], d)
    (d / "config.json").write_text(json.dumps([BASE]))
    with pytest.raises(ConfigError, match=r"must hold a JSON object \{\.\.\.\}, got a JSON list"):
        load_target(d)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_dict([BASE])


@pytest.mark.parametrize("value", ["abc", "1e-5", True, None, [1e-5], float("nan")])
def test_non_numeric_rms_norm_eps(value):
    d = {**BASE, "rms_norm_eps": value}
    if value is None:  # null = the default
        assert ModelConfig.from_dict(d).rms_norm_eps == 1e-5
        return
    with pytest.raises(ConfigError, match="rms_norm_eps must be a finite number, got"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("patch, needle", [
    ({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"num_key_value_heads": 1.5}, "num_key_value_heads must be an integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": "2"}, "eos_token_id must be an integer"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
    ({"rope_scaling": [1, 2]}, "rope_scaling must be a JSON object"),
    ({"rope_theta": "big"}, "rope_theta must be a finite number"),
    ({"layer_types": "full_attention"}, "layer_types must be a list"),
])
def test_invalid_target_config_values_are_named(patch, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        ModelConfig.from_dict({**BASE, **patch}, source="cfg.json")


def test_model_and_rope_configs_check_types_when_constructed():
    from checkpoints_tools.make_tiny import tiny_config

    for bad, needle in ((dict(rms_norm_eps="1e-5"), "rms_norm_eps"), (dict(tie_word_embeddings=1), "tie_word"),
                        (dict(eos_token_ids=[2]), "eos_token_ids"), (dict(bos_token_id=-1), "bos_token_id"),
                        (dict(architecture=["LlamaForCausalLM"]), "architecture")):
        with pytest.raises(ConfigError, match=needle):
            tiny_config("llama", **bad)
    for bad in (dict(theta="1e4"), dict(theta=float("inf")), dict(partial_rotary_factor="1"), dict(interleaved=1)):
        with pytest.raises(ConfigError):
            RopeConfig(**bad)


def test_non_utf8_config_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"architectures": ["Llama\xff"]}')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        ModelConfig.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------- draft config.json
@pytest.mark.parametrize("raw, needle", [
    ([DRAFT], "must hold a JSON object"),
    ("not json {", "not valid JSON"),
    ({**DRAFT, "num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({**DRAFT, "num_attention_heads": "four"}, "num_attention_heads must be an integer"),
    ({**DRAFT, "eagle_config": [1]}, "eagle_config must be a JSON object"),
    ({**DRAFT, "eagle_aux_hidden_state_layer_ids": 3}, "eagle_aux_hidden_state_layer_ids must be a list"),
    ({**DRAFT, "eagle_aux_hidden_state_layer_ids": ["a"]}, "eagle_aux_hidden_state_layer_ids must be an integer"),
    ({**DRAFT, "rms_norm_eps": "small"}, "rms_norm_eps must be a finite number"),
    ({**DRAFT, "norm_before_residual": "yes"}, "norm_before_residual must be true or false"),
])
def test_list_valued_or_invalid_draft_config(tmp_path, draft_dirs, targets, raw, needle):
    d = tmp_path / "d"
    shutil.copytree(draft_dirs["llama"], d)
    (d / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(ConfigError, match=needle):
        load_draft(d, targets["llama"])


def test_draft_config_and_load_draft_arguments(draft_dirs, targets):
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        DraftConfig.from_dict(DRAFT).__class__(**{**DraftConfig.from_dict(DRAFT).__dict__, "aux_layer_ids": [1]})
    with pytest.raises(ConfigError, match="needs the TargetModel"):
        load_draft(draft_dirs["llama"], str(draft_dirs["llama"]))
    with pytest.raises(ConfigError, match="aux_layer_ids entry must be an integer"):
        load_draft(draft_dirs["llama"], targets["llama"], aux_layer_ids=("0", 1, 2))
    with pytest.raises(ConfigError, match="verify must be True or False"):
        load_draft(draft_dirs["llama"], targets["llama"], verify="yes")


# ----------------------------------------------------------------------------------------- SamplingConfig
@pytest.mark.parametrize("kw, needle", [
    (dict(top_p="0.9"), r"top_p must be a finite number > 0.0 and <= 1.0, got '0.9' \(str\)"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(top_p=0.0), "top_p must be a finite number > 0.0"),
    (dict(temperature="1"), "temperature must be a finite number >= 0.0"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(temperature=-1e-12), "temperature must be a finite number >= 0.0"),
    (dict(top_k=2.0), "top_k must be an integer >= 0"),
    (dict(top_k=True), "top_k must be an integer >= 0"),
])
def test_sampling_config_types_and_ranges(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        SamplingConfig(**kw)


@pytest.mark.parametrize("t", [1e-10, 1e-20, 1e-38, 5e-324, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(t):
    from diffspec_jax import sampling

    cfg = SamplingConfig(temperature=t)
    assert cfg.greedy and cfg.temperature == 0.0 and cfg == SamplingConfig()
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 4)
    chosen = sampling.choose(jax.random.PRNGKey(0), logits, cfg)
    np.testing.assert_array_equal(np.asarray(chosen), np.argmax(np.asarray(logits), axis=-1))
    assert not SamplingConfig(temperature=GREEDY_TEMPERATURE).greedy
    assert "GREEDY_TEMPERATURE`` = 1e-5" in SamplingConfig.__doc__ and GREEDY_TEMPERATURE == 1e-5  # documented


def test_tiny_temperature_generates_the_greedy_tokens(targets):
    prompts = [[5, 6, 7, 8]]
    greedy = generate(targets["llama"], None, prompts, max_new_tokens=6, stop_token_ids=())
    tiny = generate(targets["llama"], None, prompts, max_new_tokens=6, stop_token_ids=(),
                    sampling=SamplingConfig(temperature=1e-38))
    assert tiny.tokens == greedy.tokens and 0 not in tiny.tokens[0]


# ----------------------------------------------------------------------------------------- SpecConfig
def test_tree_mode_node_count_above_what_topk_and_k_can_fill():
    with pytest.raises(ConfigError, match=r"diffspec_max_tree_nodes \(50\) exceeds the 8 candidates .* lower "
                                          r"diffspec_max_tree_nodes to <= 8"):
        SpecConfig.from_flat(dict(num_speculative_tokens=1, diffspec_verification_mode="tree"))
    ok = SpecConfig.from_flat(dict(num_speculative_tokens=1, diffspec_verification_mode="tree", diffspec_max_tree_nodes=8))
    assert ok.verification.pool_size(ok.num_speculative_tokens) == 8
    assert Tree().pool_size(2) == 8 + 64
    with pytest.raises(ConfigError, match="exceeds the 3 candidates"):
        SpecConfig.from_flat(dict(num_speculative_tokens=3, diffspec_verification_mode="tree", diffspec_tree_topk=1,
                                  diffspec_max_tree_nodes=6))


@pytest.mark.parametrize("kw, needle", [
    (dict(diffspec_keep_sink_chunk="no"), "diffspec_keep_sink_chunk must be True or False"),
    (dict(diffspec_adaptive_profile=1), "diffspec_adaptive_profile must be True or False"),
    (dict(draft_context_policy=["full"]), "draft_context_policy must be one of"),
    (dict(diffspec_tree_threshold=True), "diffspec_tree_threshold must be in"),
    (dict(diffspec_redundancy_weight=float("inf")), "diffspec_redundancy_weight must be a finite number"),
    (dict(diffspec_scoring_layer=True), "diffspec_scoring_layer must be a layer index"),
    (dict(num_speculative_tokens=4.0), "num_speculative_tokens must be a positive integer"),
])
def test_spec_config_types(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        SpecConfig.from_flat(kw)


def test_tree_mode_k1_through_the_cli_is_a_usage_error(capsys):
    code, out = gen_cli(["-k", "1", "--verification-mode", "tree", "--prompt", "x"], capsys)
    assert code == 2 and "lower diffspec_max_tree_nodes to <= 8" in one_line_error(out.err)


# ----------------------------------------------------------------------------------------- generate() arguments
@pytest.mark.parametrize("kw, needle", [
    (dict(prefill_chunk=-1), r"prefill_chunk must be an integer >= 1, got -1"),
    (dict(prefill_chunk=0), r"prefill_chunk must be an integer >= 1, got 0"),
    (dict(prefill_chunk=16.0), r"prefill_chunk must be an integer >= 1 or None, got 16.0 \(float\)"),
    (dict(prefill_chunk=True), r"prefill_chunk must be an integer"),
    (dict(stop_token_ids="2"), r"got the string '2'; pass e.g. stop_token_ids=\(2,\)"),
    (dict(stop_token_ids=2), r"got the single integer 2; pass stop_token_ids=\(2,\)"),
    (dict(stop_token_ids=[1.5]), r"stop_token_ids\[0\] must be an integer in \[0, 255\]"),
    (dict(stop_token_ids=[300]), r"stop_token_ids\[0\] must be an integer in \[0, 255\], got 300"),
    (dict(stop_token_ids={2}), r"must be a list or tuple"),
    (dict(seed=1.5), r"seed must be an integer .* got 1.5 \(float\); pass an integer such as seed=0"),
    (dict(seed=True), r"seed must be an integer"),
    (dict(seed="3"), r"seed must be an integer"),
    (dict(seed=2 ** 64), r"seed must be an integer in"),
    (dict(max_cache_len="64"), r"max_cache_len must be an integer >= 1 or None"),
    (dict(max_cache_len=0), r"max_cache_len must be an integer >= 1"),
    (dict(on_tokens=5), r"on_tokens must be a function"),
    (dict(progress="yes"), r"progress must be True or False"),
    (dict(proposer="oracle"), r"proposer must be a draft function"),
    (dict(mesh="tp4"), r"mesh must be a jax.sharding.Mesh"),
])
def test_check_generate_args_refuses(kw, needle):
    with pytest.raises(InputError, match=needle):
        check_generate_args(256, **kw)


def test_check_generate_args_normalises():
    got = check_generate_args(256, seed=np.int32(3), stop_token_ids=[np.int64(2), 7], max_cache_len=np.int64(64),
                              prefill_chunk=np.int16(16), on_tokens=print, progress=np.bool_(True))
    assert got == (3, (2, 7), 64, 16) and all(type(x) is int for x in got.stop_token_ids)
    assert type(got.seed) is int and type(got.prefill_chunk) is int
    assert check_generate_args(256) == (0, None, None, None)  # prefill_chunk None: the backend default
    assert check_generate_args(256, stop_token_ids=()).stop_token_ids == ()


# ----------------------------------------------------------------------------------------- generate CLI
@pytest.fixture(scope="module")
def cli_target(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("badcli") / "t", "llama", seed=0)


def test_empty_prompt_ids_is_refused_not_the_demo_prompt(cli_target, capsys):
    for empty in ("", " ", ",,"):
        code, out = gen_cli(["--target", str(cli_target), "--prompt-ids", empty, "--max-new-tokens", "2"], capsys)
        assert code == 2 and "--prompt-ids is empty" in one_line_error(out.err)
    code, out = gen_cli(["--target", str(cli_target), "--prompt-ids", "1,x", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "got 'x'" in one_line_error(out.err)


def test_non_utf8_prompt_file(cli_target, tmp_path, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"def f():\n    return '\xff\xfe'\n")
    code, out = gen_cli(["--prompt-file", str(bad), "--max-new-tokens", "2"], capsys)
    assert code == 2 and "is not UTF-8 text" in one_line_error(out.err)
    code, out = gen_cli(["--prompt-file", str(tmp_path), "--max-new-tokens", "2"], capsys)
    assert code == 2 and "is a directory" in one_line_error(out.err)


@pytest.mark.parametrize("args, needle", [
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--top-p", "x"], "argument --top-p: invalid float value"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0.0"),
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--seed", str(2 ** 70)], "seed must be an integer in"),
])
def test_generate_cli_usage_errors_are_one_line(cli_target, capsys, args, needle):
    code, out = gen_cli(["--target", str(cli_target), "--prompt-ids", "1,2", "--max-new-tokens", "2"] + args, capsys)
    assert code == 2 and needle in one_line_error(out.err)


def test_generate_cli_damaged_checkpoint_exits_1(cli_target, tmp_path, capsys):
    from conftest import rewrite_safetensors

    d = tmp_path / "t"
    shutil.copytree(cli_target, d)

    def poison(t):
        t["model.norm.weight"][3] = np.nan

    rewrite_safetensors(d, poison)
    code, out = gen_cli(["--target", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2"], capsys)
    assert code == 1 and "'model.norm.weight'" in one_line_error(out.err) and "NaN" in out.err


# ----------------------------------------------------------------------------------------- train_draft CLI
@pytest.mark.parametrize("args, needle", [
    (["--batch", "0"], "--batch must be an integer >= 1, got 0 (windows per training step)"),
    (["--seq-len", "-1"], "--seq-len must be an integer >= 1, got -1"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--lr", "0"], "--lr must be a finite number > 0.0"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--seed", "-3"], "--seed must be an integer >= 0"),
    (["--aux-layers", "a,b"], "wants comma-separated layer indices"),
    (["--seed", "x"], "invalid int value: 'x'"),
])
def test_train_draft_cli_bad_numbers(tiny_dirs, tmp_path, capsys, args, needle):
    from diffspec_jax.train_draft import main

    (tmp_path / "a.txt").write_text("hello world " * 20)
    try:
        code = main(["--target", str(tiny_dirs["llama"]), "--data", str(tmp_path / "a.txt"), "--out",
                     str(tmp_path / "draft")] + args)
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and needle in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "draft").exists() and not (tmp_path / "draft.partial").exists()


def test_train_draft_library_checks_its_arguments(targets):
    from diffspec_jax.train_draft import train_draft
    from diffspec_jax.training import TokenStream

    stream = TokenStream([np.arange(200) % 256], 2)
    for kw, needle in ((dict(batch=0), "batch must be an integer >= 1"), (dict(seq_len=-1), "seq_len must be"),
                       (dict(steps=1.5), "steps must be an integer"), (dict(seed=-1), "seed must be"),
                       (dict(aux_layers=(0, 9, 1)), r"aux_layers entry must be an integer in \[0, 3\]"),
                       (dict(attention="fast"), "attention must be one of"),
                       (dict(draft_vocab=1000), r"draft_vocab must be an integer in \[1, 256\]")):
        args = dict(steps=2, batch=1, seq_len=8) | kw
        with pytest.raises(ConfigError, match=needle):
            train_draft(targets["llama"], stream, **args)


def test_train_draft_non_utf8_data_file(tiny_dirs, tmp_path, capsys):
    from diffspec_jax.train_draft import main, read_texts

    (tmp_path / "a.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(InputError, match="is not UTF-8 text"):
        read_texts([str(tmp_path / "a.txt")])
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"b.jsonl:2: not a JSON object with a 'text' field"):
        read_texts([str(tmp_path / "b.jsonl")])
    code = main(["--target", str(tiny_dirs["llama"]), "--data", str(tmp_path / "a.txt"), "--out",
                 str(tmp_path / "draft")])
    assert code == 2 and "not UTF-8" in one_line_error(capsys.readouterr().err)


def test_optimiser_and_token_stream_settings():
    from diffspec_jax.training import OptimConfig, TokenStream

    for kw in (dict(lr="1e-3"), dict(lr=0.0), dict(warmup_steps=1.5), dict(total_steps=0), dict(b2=1.0)):
        with pytest.raises(ConfigError, match="optimiser"):
            OptimConfig(**kw)
    for kw in (dict(recall_fraction="0.5"), dict(recall_span=(8,)), dict(recall_noise=float("nan"))):
        with pytest.raises(ConfigError, match="recall"):
            TokenStream([], 0, **kw)


def test_load_target_arguments(tiny_dirs):
    with pytest.raises(ConfigError, match="verify must be True or False"):
        load_target(tiny_dirs["llama"], verify=1)
    with pytest.raises(PathNotFoundError, match="must be a str or pathlib.Path"):
        load_target(None)
    with pytest.raises(DiffspecError, match="dtype"):
        load_target(tiny_dirs["llama"], dtype="int8")


def test_inspect_exit_codes(tiny_dirs, tmp_path, capsys):
    from checkpoints_tools import inspect as ckpt_inspect

    assert ckpt_inspect.main([str(tmp_path / "missing")]) == 2  # a usage error: the path typed does not exist
    assert "does not exist" in one_line_error(capsys.readouterr().err)
    d = tmp_path / "t"
    shutil.copytree(tiny_dirs["llama"], d)
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    assert ckpt_inspect.main([str(d)]) == 1  # a damaged checkpoint
    assert "damaged or incomplete" in one_line_error(capsys.readouterr().err)
    with pytest.raises(SystemExit) as info:
        ckpt_inspect.main([str(d), "--bogus"])
    assert info.value.code == 2 and "unrecognized arguments" in one_line_error(capsys.readouterr().err)


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p = 1e-300 is 0 in float32: the processed distribution still keeps the argmax (found by hypothesis)."""
    from diffspec_jax import sampling

    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32)).astype(np.float32))
    cfg = SamplingConfig(temperature=1.0, top_p=8.8e-306)
    logp = np.asarray(sampling.processed_logprobs(logits, cfg))
    top = np.argmax(np.asarray(logits), axis=-1)
    assert np.allclose(logp[np.arange(2), top], 0.0) and np.isneginf(np.delete(logp[0], top[0])).all()
    np.testing.assert_array_equal(np.asarray(sampling.choose(jax.random.PRNGKey(0), logits, cfg)), top)
