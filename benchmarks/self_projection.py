"""Projected self-drafting speedups: measured step times combined with measured acceptance, no device needed.

    python benchmarks/self_projection.py \\
        --steps benchmarks/results/long_context_self_64k_b8_h200.json --steps ... \\
        --acceptance windows=PAIRED_WINDOWS.json --acceptance recall=PAIRED_RECALL.json \\
        --out benchmarks/results/self_projection_h200.json

``--steps``: ``long_context.py --draft self`` JSONs (Llama-3.1-8B shapes, random weights: the target decode step,
the self-draft cycle, one retrieval call and one working-set rebuild per context x batch x budget cell).
``--acceptance NAME=FILE``: ``paired.py --draft self`` JSONs (a trained target: mean tokens per verification of
``self-recent`` and ``self-diffspec`` at the longest context, and the retrieval interval N that run used).

Per cell and acceptance source, as ``long_context.py`` projects at its own interval:

    self-diffspec: A_diffspec * target_step / (cycle + (retrieval + rebuild) / N)
    self-recent:   A_recent   * target_step / cycle                      (no retrieval, no rebuild)

so a run whose acceptance was measured with retrieval every cycle (N = 1) pays a retrieval and a rebuild every
cycle here too. The step times and the acceptance come from different models (8B shapes vs the demo target); the
projection is what that acceptance would buy at those step times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (REPO, add_output_arguments, claim_outputs, environment, reference_line,  # noqa: E402
                               save_figure, write_json)
from diffspec_jax.config import SELF_DRAFT_INTERVAL  # noqa: E402

NOTE = ("step times from long_context.py --draft self (Llama-3.1-8B shapes, random weights), acceptance from "
        "paired.py --draft self on a trained target; self-diffspec pays a retrieval and a rebuild every N cycles, N "
        "being the interval its acceptance was measured at; self-recent pays neither")


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def acceptance_of(path: Path) -> dict:
    """Overall tokens per verification of both self policies at the longest context of a paired JSON, with the
    settings that shape it and the paired comparison."""
    data = json.loads(path.read_text())
    case = max(data["cases"], key=lambda c: c["context"])
    s = data["settings"]
    return {"self-diffspec": case["methods"]["self-diffspec"]["mean_acceptance_length"]["median"],
            "self-recent": case["methods"]["self-recent"]["mean_acceptance_length"]["median"],
            "comparison": case.get("comparisons", {}).get("self-diffspec vs self-recent"),
            "context": case["context"], "workload": s.get("workload"), "budget": s["budget"], "k": s["k"],
            # a run that left the interval at the drafter's default (None) retrieved every SELF_DRAFT_INTERVAL cycles
            "interval": s["interval"] or SELF_DRAFT_INTERVAL, "target": s.get("target"),
            "temperature": s.get("temperature", 0.0),
            "source": _rel(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def cells_of(path: Path) -> list[dict]:
    """Every (context, batch, budget) cell of a ``long_context.py --draft self`` JSON."""
    data = json.loads(path.read_text())
    out = []
    for case in data["cases"]:
        for budget, row in sorted((case.get("self_draft") or {}).items(), key=lambda kv: int(kv[0])):
            out.append({"context": case["context"], "batch": case["batch"], "budget": int(budget),
                        "target_step_s": case["target_decode_step_s"], "self_step_s": row["self_step_s"],
                        "self_step_over_target_step": row["self_step_s"] / case["target_decode_step_s"],
                        "cycle_s": row["cycle_s"], "retrieve_s": row["retrieve_s"], "rebuild_s": row["rebuild_s"],
                        "source": _rel(path), "device": data["environment"]["device"],
                        "git_commit": data["environment"]["git_commit"]})
    return out


def cycle_with_retrieval(cell: dict, interval: int) -> float:
    """Seconds per self+diffspec cycle with a retrieval and a working-set rebuild every ``interval`` cycles."""
    return cell["cycle_s"] + (cell["retrieve_s"] + cell["rebuild_s"]) / interval


def project(cell: dict, acc: dict) -> dict:
    """The two projected speedups of one cell (``cycle_s``, ``retrieve_s``, ``rebuild_s``, ``target_step_s``) at
    one acceptance source (``self-diffspec``, ``self-recent``, ``interval``; module docstring)."""
    with_retrieval = cycle_with_retrieval(cell, acc["interval"])
    return {"cycle_with_retrieval_s": with_retrieval,
            "self-diffspec": acc["self-diffspec"] * cell["target_step_s"] / with_retrieval,
            "self-recent": acc["self-recent"] * cell["target_step_s"] / cell["cycle_s"]}


def plot(payload: dict, path: Path) -> str | None:
    """Projected speedup of each policy per cell (one group of bars per cell, one bar per source and policy),
    against the 1.0x line. Returns the file name, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells, names = payload["cells"], list(payload["acceptance"])
    bars = [(n, p) for n in names for p in ("self-recent", "self-diffspec")]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(cells) + 3), 4.2))
    width = 0.8 / len(bars)
    for j, (n, p) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, [c["projected_speedup"][n][p] for c in cells], width, label=f"{p} ({n})", color=f"C{j}")
    ax.set_xticks(range(len(cells)), [f"{c['context'] // 1024}K x {c['batch']}\nbudget {c['budget']}"
                                      for c in cells], fontsize=8)
    reference_line(ax, "1.0x (target-only)")
    ax.set(title="Self-drafting: measured step times at measured acceptance (projected)",
           ylabel="projected decode speedup (x)", xlabel="context x batch, working-set budget")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", action="append", required=True, help="long_context.py --draft self JSON (repeat)")
    ap.add_argument("--acceptance", action="append", required=True,
                    help="NAME=paired.py --draft self JSON (repeat; NAME labels the source)")
    add_output_arguments(ap, None, required=True, help="output JSON (the figure is written beside it, .png)")
    args = ap.parse_args(argv)
    out, png = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    sources = {}
    for item in args.acceptance:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise SystemExit(f"--acceptance takes NAME=FILE, got {item!r}")
        if name in sources:
            raise SystemExit(f"--acceptance names {name!r} twice")
        sources[name] = acceptance_of(Path(file))
    cells = sorted((c for f in args.steps for c in cells_of(Path(f))),
                   key=lambda c: (c["batch"], c["context"], c["budget"]))
    if not cells:
        raise SystemExit("no self-draft cells in the --steps files (run long_context.py --draft self)")
    for c in cells:
        c["projected_speedup"] = {n: project(c, a) for n, a in sources.items()}
    payload = {"benchmark": "self-drafting projected speedup", "environment": environment(sys.argv), "note": NOTE,
               "acceptance": sources, "cells": cells}
    payload["figure"] = plot(payload, png)
    write_json(out, payload)
    for c in cells:
        print(f"{c['context'] // 1024}K x {c['batch']} budget {c['budget']}: self/target step "
              f"{c['self_step_over_target_step']:.2f}; " + "; ".join(
                  f"{n}: diffspec {v['self-diffspec']:.2f}x, recent {v['self-recent']:.2f}x"
                  for n, v in c["projected_speedup"].items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
