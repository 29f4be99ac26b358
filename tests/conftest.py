"""Shared fixtures. Four virtual CPU devices are configured before JAX is imported (tensor-parallel tests), and
XLA:CPU is told to compile fast (:data:`FAST_COMPILE_FLAGS`)."""

import os
import subprocess
import sys

#: XLA:CPU options for the tests: most of the suite's time is XLA compiling many small programs that then run for
#: milliseconds. LLVM at -O0 with the classic loop emitters for fusions compiles them in about half the CPU time
#: (-O0 alone saves a quarter; the emitter switch alone nothing). The code runs slower, which only tests that run
#: much (the demo pair serving many requests) notice; the suite passes unchanged under either setting.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags) -> bool:
    """Whether this jaxlib's XLA accepts ``flags`` (an unknown flag in XLA_FLAGS kills the process), asked of a
    child process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, timeout=120,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def subprocess_xla_flags() -> str:
    """XLA_FLAGS for a child process of one CPU device (a server): this session's compile options without the
    virtual devices."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f in FAST_COMPILE_FLAGS)


# asked once per test session: xdist workers and the tests' subprocesses inherit XLA_FLAGS with the options in it.
# XLA_FLAGS that already names either option (e.g. level 3, to test at XLA's defaults) is left as it is.
_flags = os.environ.get("XLA_FLAGS", "").split()
if not {f.split("=")[0] for f in _flags} & {f.split("=")[0] for f in FAST_COMPILE_FLAGS}:
    _flags += FAST_COMPILE_FLAGS if _xla_accepts(FAST_COMPILE_FLAGS) else [
        f for f in FAST_COMPILE_FLAGS if _xla_accepts([f])]  # an XLA that dropped one of them
_flag = "--xla_force_host_platform_device_count=4"
if _flag not in _flags:
    _flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DIFFSPEC_DIGEST_CACHE", "off")  # digests are remembered in-process only, never in ~/.cache
if "DIFFSPEC_COMPILATION_CACHE" not in os.environ:
    # the engine's persistent compilation cache, in a directory of this test session's own (made by the first
    # process that imports this file: under xdist the controller, whose environment the workers and the tests'
    # subprocesses inherit; removed at exit): a program one test compiled loads in the next test that builds it
    # (about a fifth off the engine-heavy modules' time). Never the user's ~/.cache. Tests of the cache itself
    # point it elsewhere.
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix=f"diffspec-tests-jax-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
    atexit.register(shutil.rmtree, _jax_cache, True)
    os.environ["DIFFSPEC_COMPILATION_CACHE"] = _jax_cache

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ARCHS = ("llama", "qwen3")

#: memory mappings after which compiled executables are dropped between test modules (Linux's default limit,
#: vm.max_map_count, is 65530; each XLA:CPU executable holds about three, and the whole suite compiles enough of
#: them to pass the limit, where XLA's compiler segfaults on a failed mmap)
MAX_MAPPINGS = 24000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to watch
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_code():
    """Drop JAX's compiled executables after a module when the process holds many memory mappings."""
    yield
    if _mappings() > MAX_MAPPINGS:
        import jax

        jax.clear_caches()


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (a norm-relative error; elementwise ratios blow up near 0)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random float32 checkpoints written by transformers itself: {"llama": dir, "qwen3": dir}."""
    from checkpoints_tools.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch, backend="transformers", seed=11 + i)
            for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs):
    """The transformers (torch, float32, eager attention) reference models."""
    import torch
    import transformers

    torch.set_num_threads(2)
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager").eval() for arch, d in tiny_dirs.items()}


@pytest.fixture(scope="session")
def targets(tiny_dirs):
    """Our float32 targets loaded from the same directories."""
    from diffspec_jax import load_target

    return {arch: load_target(d, dtype="float32") for arch, d in tiny_dirs.items()}


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="session")
def draft_dirs(tmp_path_factory, targets):
    """Random EAGLE-3 drafts: Llama with a smaller draft vocabulary (128 < 256) and explicit aux ids;
    Qwen3 with the full vocabulary (no d2t/t2d tensors) and the default aux ids."""
    from checkpoints_tools.make_tiny import make_tiny_draft

    root = tmp_path_factory.mktemp("drafts")
    return {"llama": make_tiny_draft(root / "llama", targets["llama"].config, draft_vocab_size=128, seed=21,
                                     aux_layer_ids=(0, 2, 3)),
            "qwen3": make_tiny_draft(root / "qwen3", targets["qwen3"].config, seed=22)}


@pytest.fixture(scope="session")
def drafts(draft_dirs, targets):
    from diffspec_jax import load_draft

    return {arch: load_draft(d, targets[arch]) for arch, d in draft_dirs.items()}


def check_cached_steps(model, cache, seqs, lengths, ref, tol):
    """After a ragged prefill of ``seqs[b, :lengths[b]]``: T = 1, 5, 1, 5 cached steps continue each sequence, and
    every step's logits match ``ref [B, T, V]`` (norm-relative error <= tol)."""
    from diffspec_jax import target as tgt

    start = np.array(lengths)
    for t in (1, 5, 1, 5):
        toks = np.stack([seqs[b, start[b]:start[b] + t] for b in range(len(lengths))])
        step_logits, cache = tgt.decode(model, cache, toks, start)
        for b in range(len(lengths)):
            assert rel_err(step_logits[b], ref[b, start[b]:start[b] + t]) <= tol
        start = start + t


def layer_temp_growth(attend, q, bufs, few=4, many=16) -> tuple[int, int]:
    """How much a program's temporaries grow from ``few`` to ``many`` layers, each ``q = attend(q, k, v) * 1.001``
    over its own pair of ``bufs`` (XLA's count of the compiled program on this CPU), and the bytes of one float32
    ``q``: a loop carry that depends on nothing may be made for every layer at a program's start (issue 41)."""
    import jax

    def temp_bytes(layers):
        def chain(q, bufs):
            for i in range(layers):
                q = (attend(q, bufs[2 * i], bufs[2 * i + 1]) * 1.001).astype(q.dtype)
            return q
        return jax.jit(chain).lower(q, bufs[:2 * layers]).compile().memory_analysis().temp_size_in_bytes

    return temp_bytes(many) - temp_bytes(few), q.size * 4


def random_prompts(seed, lengths, vocab=256):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def recording_proposer(log, plan, dparams, state, active, key):
    """The engine's draft proposer, also appending each cycle's drafts (host NumPy) to ``log``."""
    import jax

    from diffspec_jax.engine import draft_propose

    out = draft_propose(plan, dparams, state, active, key)
    jax.debug.callback(lambda d: log.append(np.asarray(d)), out[0])
    return out


def rewrite_safetensors(path, edit, name="model.safetensors"):
    """Load ``path/name``, apply ``edit(dict)`` in place, write it back (to damage checkpoints)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / name))
    edit(tensors)
    save_file(tensors, str(path / name), metadata={"format": "pt"})
