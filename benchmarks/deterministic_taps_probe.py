"""Does tapping the residual stream for a draft change the target step's bits? (issue 40)

    python -m benchmarks.deterministic_taps_probe --out benchmarks/results/lossless_h200/taps_probe_h200.json

EAGLE-3's verify step returns the target's hidden states at three layers (``llama.step(aux_layers=...)``);
target-only decoding taps nothing. On the demo pair (bf16, a cache of random values, K + 1 = 5 rows at random
lengths, 3 trials) the script runs the deterministic target step (``use_deterministic(True)``, excess precision off)
with and without the taps (and with the taps fed to a matrix product, as the draft's ``fc`` consumes them), and
counts the logits whose bits differ, per variant of where optimization barriers sit:

* ``none``: no barrier (the library's :func:`diffspec_jax.models.layers.layer_boundary` replaced by the identity);
* ``tap_barrier``: a barrier on each tapped value only;
* ``layer_barrier``: a barrier on the residual stream after every layer (the library's deterministic form);
* ``both``.

On an H200 (2026-12-04) ``none`` and ``tap_barrier`` differed in 4096 and 16383 of 81920 logits in two of the
three trials; ``layer_barrier`` and ``both`` matched to the bit in all three. On a CPU every variant matches.
The variants are swapped in by replacing module functions for the duration of a trace (an experiment, not a path
the engine takes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_arguments, claim_outputs, environment, write_json

VARIANTS = ("none", "tap_barrier", "layer_barrier", "both")


def _patched(llama, name: str):
    """Set the module's barrier functions for ``name``; returns a function that restores them."""
    saved = llama.layer_boundary, llama.concat_aux
    bar = jax.lax.optimization_barrier
    if name in ("none", "tap_barrier"):
        llama.layer_boundary = lambda x: x
    if name in ("tap_barrier", "both"):
        llama.concat_aux = lambda aux, layers, n: saved[1]([(j, bar(x)) for j, x in aux], layers, n)

    def restore():
        llama.layer_boundary, llama.concat_aux = saved

    return restore


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="diffspec_jax/demo/pair")
    ap.add_argument("--trials", type=int, default=3)
    add_output_arguments(ap, "benchmarks/results/taps_probe.json")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)

    import diffspec_jax as dj
    from benchmarks.long_context import fill_random
    from diffspec_jax.cache import create_cache
    from diffspec_jax.engine.compile import DETERMINISTIC_COMPILER_OPTIONS
    from diffspec_jax.models import llama
    from pallas_kernels.common import use_deterministic

    target = dj.load_target(Path(args.pair) / "target", dtype="bfloat16")
    aux = dj.load_draft(Path(args.pair) / "draft", target).aux_layers
    tc = target.config
    b, t, capacity, ctx = 4, 5, 4096, 3000
    w = jax.random.normal(jax.random.PRNGKey(3), (len(aux) * tc.hidden_size, tc.hidden_size), jnp.bfloat16) * 0.02

    def program(taps: bool, consume: bool):
        def f(params, cache, toks, start, rows):
            with use_deterministic(True):
                o, _ = llama.step(tc, params, cache, toks, start, rows, aux_layers=aux if taps else ())
            return o.logits, (o.aux @ w if consume else o.aux) if taps else None
        return jax.jit(f, compiler_options=dict(DETERMINISTIC_COMPILER_OPTIONS))

    cache = fill_random(create_cache(tc, b, capacity, jnp.bfloat16))
    rng = np.random.default_rng(0)
    results = {}
    for _ in range(args.trials):
        toks = jnp.asarray(rng.integers(0, tc.vocab_size, (b, t)), jnp.int32)
        start = jnp.asarray(rng.integers(ctx // 2, ctx, b), jnp.int32)
        rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        for name in VARIANTS:
            restore = _patched(llama, name)
            try:
                base = program(False, False)(target.params, cache, toks, start, rows)[0]
                for consume in (False, True):
                    got = program(True, consume)(target.params, cache, toks, start, rows)[0]
                    differ = np.asarray(base != got)
                    results.setdefault(f"{name}/consume={consume}", []).append(
                        {"bits_differ": int(differ.sum()), "of": int(differ.size),
                         "max_abs": float(jnp.max(jnp.abs(base - got)))})
            finally:
                restore()
    for key, rows_ in results.items():
        print(key, [r["bits_differ"] for r in rows_])
    write_json(out, {"probe": "tapped vs untapped deterministic target step, logits bit for bit",
                     "environment": environment(sys.argv), "settings": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
