"""Are the target's matrix products row-invariant on this device? (issues 37 and 40)

    python -m benchmarks.gemm_invariance --out benchmarks/results/gemm_invariance.json [--option KEY=VALUE ...]

A greedy answer is the same in the server and in ``generate()`` alone only if a row's logits do not depend on how
many rows share its step: a 12-slot server's verify step multiplies 12 x (K + 1) = 60 rows by each weight, a batch-1
``generate()``'s 5. XLA picks each product's kernel per shape, and on a GPU by timing candidates when it compiles
(autotuning), so two programs, or two runs of one, may split the inner dimension differently and round a row
differently.

For Llama-3.1-8B's weight shapes (random bf16, fresh per run) the script multiplies the first ``M`` rows of a random
bf16 activation block for each ``M`` of ``--rows``, each ``M`` its own compiled program, in the two result types
the deterministic plan uses (bfloat16 for the q/k/v and gate/up products, float32 for the ones feeding the
residual stream), and counts the elements of the first 5 rows whose bits differ from the ``M = 5`` program's. It
prints a digest of the ``M = 5`` results, so separate runs (processes) can be compared for run-to-run changes.
``--option`` passes an XLA option to every compile (``xla_gpu_autotune_level=0``: no autotuning).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_arguments, claim_outputs, environment, write_json

#: (name, inner dimension, outer dimension): Llama-3.1-8B's products of one decoder layer and the LM head
SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
          ("lm_head", 4096, 128256))
BASE_ROWS = 5


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="5,10,20,40,60,120,2048", help="row counts M (comma-separated)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--option", action="append", default=[], help="an XLA option for every compile, KEY=VALUE")
    ap.add_argument("--seed", type=int, default=None, help="weights' seed (default: fresh)")
    add_output_arguments(ap, "benchmarks/results/gemm_invariance.json")
    args = ap.parse_args(argv)
    out, = claim_outputs(ap, args, [args.out], __file__)
    options = dict(_option(o) for o in args.option) or None
    rows = sorted({BASE_ROWS, *(int(m) for m in args.rows.split(","))})
    seed = int(np.random.SeedSequence().entropy % (1 << 31)) if args.seed is None else args.seed
    key = jax.random.PRNGKey(seed)
    results = []
    for name, k, n in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        kx, kw, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, (max(rows), k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        for out_dtype in (jnp.bfloat16, jnp.float32):
            def product(a, b, dt=out_dtype):
                return jnp.matmul(a, b, preferred_element_type=dt)

            base = None
            row = {"shape": name, "k": k, "n": n, "result": jnp.dtype(out_dtype).name, "differing": {}}
            for m in rows:
                fn = jax.jit(product).lower(x[:m], w).compile(compiler_options=options)
                y = np.asarray(jax.device_get(fn(x[:m], w)))[:BASE_ROWS]
                if base is None:
                    base = y
                    row["digest"] = hashlib.sha256(y.tobytes()).hexdigest()[:16]
                bits = f"u{y.itemsize}"  # the elements' bits as unsigned integers of their width
                row["differing"][str(m)] = int(np.count_nonzero(y.view(bits) != base.view(bits)))
            print(row, flush=True)
            results.append(row)
    write_json(out, {"benchmark": "gemm_invariance: rows of a matrix product whose bits depend on the row count",
                     "environment": environment(sys.argv), "seed": seed, "options": options, "rows": rows,
                     "base_rows": BASE_ROWS, "results": results,
                     "invariant": all(v == 0 for r in results for v in r["differing"].values())})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
