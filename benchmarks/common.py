"""Shared benchmark helpers: environment record, device copy bandwidth, timing, safe output files."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffspec_jax.errors import OutputDirError
from diffspec_jax.outdir import OutputFile, png_metadata

REPO = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/X.py`, Python puts this folder first on sys.path, where a script's module name would
# shadow an installed package of that name: transformers 5.2x finds our kernels.py as the `kernels` package and then
# fails to import from it. Every script imports this module before transformers, so the folder is dropped here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def environment(argv: Sequence[str]) -> dict[str, Any]:
    """Command, git commit, machine, device and package versions, date."""
    commit = os.environ.get("DIFFSPEC_GIT_COMMIT")  # set by callers that run on a copy without .git
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
            commit = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "transformers", "torch", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    return {"command": " ".join([Path(sys.executable).name] + list(argv)), "git_commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(),
            "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "device_count": jax.device_count(), "versions": versions}


def time_fn(fn: Callable, inputs: Sequence[tuple], *, repeats: int = 15, inner: int = 20) -> dict[str, float]:
    """Median seconds per call of ``fn(*inputs[i])`` (rotating input sets so caches do not serve repeats).

    Each repeat dispatches ``inner`` calls back to back and waits once, so host dispatch overlaps device work;
    the median and coefficient of variation are over repeats.
    """
    out = None
    for args in inputs:  # warm-up: compile and run every input set
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*inputs[i % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    med = statistics.median(times)
    cv = statistics.pstdev(times) / statistics.mean(times) if len(times) > 1 else 0.0
    return {"median_s": med, "cv": cv, "repeats": repeats, "inner": inner}


def chained(fn: Callable, inner: int = 20) -> Callable:
    """A jitted program of ``inner`` chained calls ``fn(q, *args) -> (out, ...)``: each call's query depends on the
    last output, so none is elided or overlapped (a kernel timed in a loop on the device, no host gap)."""
    def run(q, *a):
        def body(i, acc):
            o, _ = fn(q + acc.astype(q.dtype) * 0, *a)
            return acc + o[0, 0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, inner, body, jnp.zeros((), jnp.float32))

    return jax.jit(run)


def per_call_s(program: Callable, *args, inner: int = 20) -> float:
    """Seconds per call of a :func:`chained` program of ``inner`` calls (one warm run, then one timed)."""
    jax.block_until_ready(program(*args))
    t = time.perf_counter()
    jax.block_until_ready(program(*args))
    return (time.perf_counter() - t) / inner


def time_device(step: Callable, carry: Any, *, iters: int = 50, repeats: int = 7) -> dict[str, float]:
    """Device seconds per call of ``step`` without host dispatch: ``iters`` calls run inside one jitted
    ``fori_loop`` (``carry = step(carry)``; the step must make each call depend on the carry so nothing is
    hoisted), repeated ``repeats`` times; median and coefficient of variation over repeats."""
    loop = jax.jit(lambda c: jax.lax.fori_loop(0, iters, lambda i, x: step(x), c), donate_argnums=(0,))
    carry = loop(carry)  # compile + warm-up
    jax.block_until_ready(carry)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = loop(carry)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t0) / iters)
    med = statistics.median(times)
    cv = statistics.pstdev(times) / statistics.mean(times) if len(times) > 1 else 0.0
    return {"median_s": med, "cv": cv, "repeats": repeats, "iters": iters}


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> dict[str, float]:
    """Device copy bandwidth: bytes read + written by an elementwise pass over a ``nbytes`` float32 array."""
    n = nbytes // 4
    t = time_device(lambda x: x + 1.0, jnp.arange(n, dtype=jnp.float32), iters=10, repeats=repeats)
    return {"bytes_per_s": 2 * n * 4 / t["median_s"], "array_bytes": n * 4, **t}


#: the tool name recorded in outputs written through a bare path (not claimed by a script)
TOOL = "benchmarks"


def add_output_arguments(ap, default: str | None, *, required: bool = False,
                         help: str = "output JSON (a figure beside it, where the benchmark draws one)") -> None:
    """``--out`` and ``--overwrite`` (see :func:`claim_outputs`)."""
    ap.add_argument("--out", default=default, required=required, help=help)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output file that no diffspec tool wrote (it is moved to "
                         "NAME.replaced-<time>, nothing is deleted); a benchmark's own earlier output is replaced "
                         "without it")


def claim_outputs(ap, args, paths: Sequence[str | Path], script: str) -> list[OutputFile]:
    """The output files of this run, checked before it measures anything (:class:`OutputFile`: an existing file
    that no diffspec tool wrote is refused without ``--overwrite``); a refusal is a usage error (``ap.error``: one
    line, exit status 2). ``script``: the benchmark's ``__file__``."""
    outs = [OutputFile(p, tool=f"benchmarks/{Path(script).name}", overwrite=getattr(args, "overwrite", False))
            for p in paths]
    try:
        for out in outs:
            out.check()
    except OutputDirError as exc:
        ap.error(str(exc))
    return outs


def _output(out: OutputFile | str | Path) -> OutputFile:
    return out if isinstance(out, OutputFile) else OutputFile(out, tool=TOOL)


def add_plot_only_argument(ap) -> None:
    """``--plot-only FILE``: redraw the figure of an earlier run's JSON (see :func:`redraw`)."""
    ap.add_argument("--plot-only", default=None, help="redraw the PNG of this JSON and exit")


def redraw(ap, args, plot, script: str, prepare=lambda payload: payload) -> bool:
    """With ``--plot-only FILE``: draw ``plot(prepare(payload), png)`` beside FILE (the PNG claimed like any output)
    and print its name; returns whether it did (the benchmark then exits)."""
    if not getattr(args, "plot_only", None):
        return False
    path = Path(args.plot_only)
    print(plot(prepare(json.loads(path.read_text())), claim_outputs(ap, args, [path.with_suffix(".png")], script)[0]))
    return True


def write_json(out: OutputFile | str | Path, payload: dict) -> Path:
    """Write ``payload`` to a claimed output (:func:`claim_outputs`), or to a path under the same rules (a file
    that no diffspec tool wrote is refused); the temporary-file-and-rename write and the mark are
    :meth:`OutputFile.write_json`'s."""
    return _output(out).write_json(payload)


def repo_relative(path: str | Path | None) -> str | None:
    """``path`` as a repository-relative path for a figure title: a relative path as given; an absolute one by
    its longest tail that names something in this repository (``/root/clone/diffspec_jax/demo/pair/target`` ->
    ``diffspec_jax/demo/pair/target``, wherever the run's checkout was); ``None`` for anything else (the title
    then names no path)."""
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    parts = p.parts[1:]
    for i in range(len(parts)):
        tail = Path(*parts[i:])
        if (REPO / tail).exists():
            return tail.as_posix()
    return None


def context_axis(ax, contexts: Sequence[int]) -> None:
    """A context-length x axis: log2 scale, one tick per measured context labelled ``2K`` / ``16K`` / ``512``."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(contexts), [f"{c / 1024:g}K" if c >= 1024 else str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")


def log_yticks(ax, most: int = 8) -> None:
    """Plain-number ticks (``0.3``, ``1``, ``4``, ``20``) on a log-scaled y axis, spanning the plotted data (a
    log axis otherwise labels only powers of ten, often one or none)."""
    import matplotlib.ticker

    shown = [float(v) for line in ax.get_lines() for v in line.get_ydata() if v is not None and float(v) > 0
             and float(v) < float("inf")]
    if not shown:
        return
    lo, hi = 0.9 * min(shown), 1.1 * max(shown)
    ticks = [m * 10.0 ** e for e in range(-4, 6) for m in (1, 1.5, 2, 3, 4, 6) if lo <= m * 10.0 ** e <= hi]
    ticks = ticks[::-(-len(ticks) // most)] if ticks else ticks
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def reference_line(ax, label: str = "1.0x (no gain)", y: float = 1.0) -> None:
    """The 1.0x line of a speedup or ratio axis (or the ``y`` line of a difference axis)."""
    ax.axhline(y, color="black", lw=0.8, ls="--", label=label)


def save_figure(fig, out: OutputFile | str | Path, dpi: int = 120) -> str:
    """Lay out, write (PNG, marked as a benchmark's output; like :func:`write_json`) and close a matplotlib figure;
    returns the file name for the JSON's ``figure``."""
    import io

    import matplotlib.pyplot as plt

    out = _output(out)
    fig.tight_layout()
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=dpi, metadata=png_metadata(out.tool))
    plt.close(fig)
    return out.write_bytes(data.getvalue()).name


def rel_err(a, b) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (both cast to float32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def matmul_peak(n: int = 8192, repeats: int = 7) -> dict[str, float]:
    """bf16 matrix-product rate on random data: ``[n, n] @ [n, n]`` chained inside one jitted loop (the ceiling
    that prefill throughput is compared with). Returns ``{"flop_per_s", "n", "median_s", ...}``."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(jnp.bfloat16) * (n ** -0.5)
    t = time_device(lambda x: (x @ b).astype(jnp.bfloat16), a, iters=10, repeats=repeats)
    return {"flop_per_s": 2 * n ** 3 / t["median_s"], "n": n, **t}
