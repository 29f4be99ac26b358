"""Issue 26, property-based: every input to SpecConfig, SamplingConfig, generate() and the command-line tools
either works or raises one of the project's named errors (DiffspecError subclasses; exit status 2 / 1 with one
line on stderr from a CLI), never another exception; and no CLI invocation changes its inputs or deletes a user's
file. Example counts are modest and every model shape is fixed, so the compilations are cached across examples."""

import hashlib
import importlib
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from diffspec_jax import SamplingConfig, SpecConfig
from diffspec_jax.errors import ConfigError, DiffspecError, InputError
from diffspec_jax.validation import check_generate_args

#: DIFFSPEC_HYPOTHESIS_SCALE=20 runs 20x the examples (a deeper local search; CI keeps the default 1)
SCALE = int(os.environ.get("DIFFSPEC_HYPOTHESIS_SCALE", "1"))
SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
GARBAGE = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True, allow_infinity=True),
                    st.lists(st.integers(0, 3), max_size=2), st.just(object()))


def ints(lo, hi):
    """Mostly integers around the valid range, sometimes anything at all."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi), GARBAGE)


def reals(lo, hi):
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.integers(int(lo), int(hi)), GARBAGE)


def choice(values):
    return st.one_of(st.sampled_from(values), st.sampled_from(values), GARBAGE)


SPEC_FIELDS = {
    "num_speculative_tokens": ints(-1, 9), "draft_context_policy": choice(["full", "recent", "diffspec", "x"]),
    "draft_sampling": choice(["argmax", "sample"]), "diffspec_chunk_size": ints(-1, 70),
    "diffspec_token_budget": ints(-1, 300), "diffspec_retrieval_interval": ints(-1, 9),
    "diffspec_keep_sink_chunk": choice([True, False]), "diffspec_retrieve_after_prefill": choice([True, False]),
    "diffspec_adaptive_profile": choice([True, False]), "diffspec_long_context_threshold": ints(-1, 10 ** 6),
    "diffspec_long_context_depth": ints(-1, 9), "diffspec_verification_mode": choice(["auto", "linear", "tree"]),
    "diffspec_max_tree_nodes": ints(-1, 300), "diffspec_tree_topk": ints(-1, 12),
    "diffspec_tree_threshold": reals(-0.5, 1.5), "diffspec_tree_branching": choice(["hazard", "full", "uniform2", "u"]),
    "diffspec_scorer": choice(["attention", "salience"]), "diffspec_redundancy_weight": reals(-1, 3),
    "diffspec_scoring_layer": st.one_of(st.none(), ints(-1, 5)), "draft_tensor_parallel_size": st.one_of(
        st.none(), ints(-1, 4)),
    "ngram_min_n": ints(-1, 5), "ngram_max_n": ints(-1, 40), "ngram_first": choice([True, False]),
}


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(st.fixed_dictionaries({}, optional=SPEC_FIELDS))
def test_spec_config_works_or_raises_config_error(kw):
    try:
        spec = SpecConfig.from_flat(kw)
    except ConfigError:
        return
    # a config that constructs is consistent
    assert spec.num_speculative_tokens >= 1 and spec.history_budget >= 0 and spec.max_chunks >= 0
    if spec.tree:
        tree = spec.verification
        assert spec.num_speculative_tokens <= tree.max_nodes <= min(255, tree.pool_size(spec.num_speculative_tokens))
        assert tree.topk <= tree.max_nodes
    if spec.uses_working_cache:
        assert spec.max_chunks >= (2 if getattr(spec.context, "keep_sink_chunk", False) else 1)
    assert 1 <= spec.ngram.min_n <= spec.ngram.max_n <= 32
    hash(spec)


LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32)).astype(np.float32) * 3)


@settings(max_examples=50 * SCALE, **SETTINGS)
@given(temperature=st.one_of(st.floats(0, 5), st.floats(0, 1e-30), GARBAGE, st.floats(-1, 0)),
       top_k=st.one_of(st.integers(-2, 40), GARBAGE), top_p=st.one_of(st.floats(-0.5, 1.5), GARBAGE))
def test_sampling_config_works_or_raises_config_error(temperature, top_k, top_p):
    from diffspec_jax import sampling

    try:
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    except ConfigError:
        return
    assert math.isfinite(cfg.temperature) and (cfg.temperature == 0 or cfg.temperature >= 1e-5)
    tok = np.asarray(sampling.choose(jax.random.PRNGKey(1), LOGITS, cfg))
    assert tok.dtype == np.int32 and ((0 <= tok) & (tok < 32)).all()
    if cfg.greedy:
        np.testing.assert_array_equal(tok, np.argmax(np.asarray(LOGITS), axis=-1))
    else:
        assert np.isfinite(np.asarray(sampling.processed_logprobs(LOGITS, cfg))[np.arange(2), tok]).all()


GEN_ARGS = dict(
    seed=st.one_of(st.integers(-(2 ** 64), 2 ** 64), GARBAGE),
    stop_token_ids=st.one_of(st.none(), st.lists(st.one_of(st.integers(-3, 300), GARBAGE), max_size=3),
                             st.tuples(st.integers(0, 255)), st.text(max_size=2), st.integers(0, 9), GARBAGE),
    max_cache_len=st.one_of(st.none(), st.integers(-2, 200), GARBAGE),
    prefill_chunk=st.one_of(st.integers(-3, 600), GARBAGE),
    on_tokens=st.one_of(st.none(), st.just(lambda i, ids: None), GARBAGE),
    progress=st.one_of(st.booleans(), GARBAGE),
)


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(**GEN_ARGS)
def test_check_generate_args_works_or_raises_input_error(**kw):
    try:
        got = check_generate_args(256, **kw)
    except InputError:
        return
    assert type(got.seed) is int
    assert got.prefill_chunk is None or (type(got.prefill_chunk) is int and got.prefill_chunk >= 1)
    assert got.max_cache_len is None or (type(got.max_cache_len) is int and got.max_cache_len >= 1)
    assert got.stop_token_ids is None or all(type(t) is int and 0 <= t < 256 for t in got.stop_token_ids)


class _Handle:
    """A fixture value with a short repr (hypothesis prints the arguments of a failing example)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return "<tiny llama target>"


@pytest.fixture(scope="module")
def tiny_target(targets):
    return _Handle(targets["llama"])


NOT_INT = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True, allow_infinity=True),
                   st.lists(st.integers(0, 3), max_size=2), st.just(object()))
#: per generate() argument: values that must work, and values that must be refused with a named error
VALID = dict(max_new_tokens=st.sampled_from([3, 2]), seed=st.integers(-(2 ** 63), 2 ** 63 - 1),
             stop_token_ids=st.one_of(st.none(), st.just(()), st.lists(st.integers(0, 255), max_size=2)),
             max_cache_len=st.sampled_from([None, 64]), prefill_chunk=st.sampled_from([512, 16]),
             on_tokens=st.one_of(st.none(), st.just(lambda i, ids: None)))
INVALID = dict(
    max_new_tokens=st.one_of(st.integers(-3, 0), NOT_INT.filter(lambda x: x is not None)),
    seed=st.one_of(st.integers(2 ** 63, 2 ** 70), st.integers(-(2 ** 70), -(2 ** 63) - 1), NOT_INT),
    stop_token_ids=st.one_of(st.text(min_size=1, max_size=2), st.integers(0, 9), st.lists(st.one_of(
        st.integers(256, 400), st.integers(-5, -1), st.floats(), st.text(max_size=1), st.booleans()), min_size=1,
        max_size=2), st.floats(), st.just(object())),
    max_cache_len=st.one_of(st.integers(-2, 0), NOT_INT.filter(lambda x: x is not None)),
    prefill_chunk=st.one_of(st.integers(-3, 0), NOT_INT.filter(lambda x: x is not None)),
    on_tokens=st.one_of(st.integers(), st.text(max_size=2), st.floats()))


@settings(max_examples=30 * SCALE, phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking
          **SETTINGS)
@given(data=st.data(), broken=st.sampled_from([None] + sorted(VALID)),
       sampling=st.sampled_from([SamplingConfig(), SamplingConfig(temperature=0.7, top_k=5)]))
def test_generate_works_or_raises_a_named_error(tiny_target, data, broken, sampling):
    """Valid arguments generate; any one invalid argument is refused with a named error (never run with a wrong
    meaning, never another exception)."""
    from diffspec_jax import generate

    kw = {name: data.draw(strategy, label=name) for name, strategy in VALID.items()}
    if broken is not None:
        kw[broken] = data.draw(INVALID[broken], label=f"invalid {broken}")
    try:
        res = generate(tiny_target.value, None, [[3, 4, 5]], sampling=sampling, **kw)
    except DiffspecError:
        assert broken is not None, kw
        return
    assert broken is None, f"generate() accepted {broken}={kw[broken]!r}"
    out = res.tokens[0]
    assert 1 <= len(out) <= kw["max_new_tokens"] and all(0 <= t < 256 for t in out)
    stops = set((2,) if kw["stop_token_ids"] is None else kw["stop_token_ids"])
    assert not any(t in stops for t in out[:-1])  # generation stopped at the first stop token


# ------------------------------------------------------------------------------------------ generate CLI
@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("prop_cli")
    target = make_tiny(root / "t", "llama", seed=0)
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    (root / "ok.txt").write_text("hello")
    return {"target": target, "root": root}


OPTIONS = {
    "--max-new-tokens": ["2", "0", "-1", "x", "1.5", ""], "-k": ["4", "0", "-2", "x"],
    "--temperature": ["0", "-1", "nan", "inf", "1e-40", "x"], "--top-k": ["0", "-1", "2.5"],
    "--top-p": ["1", "0", "1.5", "nan"], "--seed": ["0", "-1", "1.5", str(2 ** 70), "x"],
    "--policy": ["full", "bogus", "diffspec"], "--chunk-size": ["64", "0", "7"], "--token-budget": ["2048", "-5"],
    "--verification-mode": ["auto", "tree", "dag"], "--max-tree-nodes": ["50", "0", "300"],
    "--tree-topk": ["8", "0", "99"], "--tree-branching": ["hazard", "bushy"], "--tree-threshold": ["0", "2", "nan"],
    "--tp": ["1", "0", "-1"], "--draft-tp": ["1", "0"], "--dtype": ["auto", "float32", "int8"],
}
FLAGS = ["--ignore-eos", "--json", "--no-progress", "--chat", "--adaptive", "--bogus-flag"]


@st.composite
def cli_args(draw):
    args = []
    prompt = draw(st.sampled_from(["ids", "ids", "bad_ids", "text", "file", "latin1", "dir", "missing"]))
    args += {"ids": ["--prompt-ids", "1,2,3"], "text": ["--prompt", "hi"], "file": ["--prompt-file", "{root}/ok.txt"],
             "latin1": ["--prompt-file", "{root}/latin1.txt"], "dir": ["--prompt-file", "{root}"],
             "missing": ["--prompt-file", "{root}/nope.txt"],
             "bad_ids": ["--prompt-ids", draw(st.sampled_from(["", " , ", "1,x", "999999", "-1", "1;2"]))]}[prompt]
    for opt in draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=4, unique=True)):
        args += [opt, draw(st.sampled_from(OPTIONS[opt]))]
    args += draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))
    return args


@settings(max_examples=40 * SCALE, **SETTINGS)
@given(args=cli_args())
def test_generate_cli_exits_0_1_or_2_and_never_with_a_traceback(cli_dirs, capsys, args):
    from diffspec_jax import engine

    cli = importlib.import_module("diffspec_jax.generate")
    args = ["--target", str(cli_dirs["target"]), "--no-draft", "--max-new-tokens", "2"] + [
        a.format(root=cli_dirs["root"]) for a in args]
    real = engine.generate

    def target_only(target, draft, prompts, **kw):  # without a draft the spec is ignored: keep one compilation
        assert draft is None
        return real(target, None, prompts, **{**kw, "spec": SpecConfig()})

    engine.generate = target_only
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse
        code = exc.code
    finally:
        engine.generate = real
    out = capsys.readouterr()
    assert code in (0, 1, 2), (args, out.err)
    if code:  # one error line (besides the "[RANDOM weights ...]" banner of a random checkpoint), no traceback
        lines = [ln for ln in out.err.splitlines() if ln.strip() and not ln.startswith("[RANDOM weights")]
        assert "Traceback" not in out.err and len(lines) == 1 and "error" in lines[0], (args, out.err)
    elif "--json" in args:
        assert len(json.loads(out.out)["ids"]) <= 2


# ------------------------------------------------------------------------------------------ convert CLI
def digest(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def convert_src(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("prop_convert") / "hf", "llama", seed=1)


@settings(max_examples=20 * SCALE, **SETTINGS)
@given(out=st.sampled_from(["new", "src", "src/sub", "user", "file", "parent", "user/inner"]),
       overwrite=st.booleans(), dtype=st.sampled_from([[], ["--dtype", "float32"], ["--dtype", "int4"]]),
       source=st.sampled_from(["src", "src", "missing", "file"]))
def test_convert_never_touches_its_source_or_a_users_files(convert_src, tmp_path_factory, capsys, out, overwrite,
                                                           dtype, source):
    from checkpoints_tools import convert

    root = tmp_path_factory.mktemp("case")
    src = root / "src"
    shutil.copytree(convert_src, src)
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("mine")
    (root / "file").write_text("a file")
    before = digest(root)
    paths = {"new": root / "new", "src": src, "src/sub": src / "sub", "user": root / "user", "file": root / "file",
             "parent": root, "user/inner": root / "user" / "inner", "missing": root / "missing"}
    args = ["--hf", str(paths[source]), "--out", str(paths[out])] + dtype + (["--overwrite"] if overwrite else [])
    try:
        code = convert.main(args)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 1, 2) and "Traceback" not in err
    after = digest(root)
    # every file that was there is still there, unchanged (possibly moved to user.replaced-<time> by --overwrite)
    moved = {k.split("/", 1)[1]: v for k, v in after.items() if k.startswith("user.replaced-")}
    for rel, h in before.items():
        if rel.startswith("user/") and out == "user" and overwrite and code == 0:
            assert moved[rel[len("user/"):]] == h
        else:
            assert after.get(rel) == h, (args, rel, err)
    assert not [p for p in root.iterdir() if p.name.endswith(".partial")]
