"""The first-contact check on a CPU: one short request through the no-argument server against the CLI.

Runs ``python -m diffspec_jax.generate --prompt PROMPT --max-new-tokens N --ignore-eos --json`` (which warms both of
its paths up before the timed run, so its ``prefill_s + decode_s`` is the generation alone) and the same request
over HTTP to ``python -m diffspec_jax.serve`` started with no arguments (the CPU defaults), timed by the client from
request to full response. Both greedy (temperature 0) and sampled (temperature 1 with a seed, which the CLI and the
server turn into the same token stream): the server's own default is temperature 1, the CLI's is the model's
generation config (greedy for the embedded pair). Writes ``--out`` (JSON) and a PNG beside it.

    python benchmarks/cpu_first_request.py --out benchmarks/results/cpu_first_request.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import add_output_arguments, claim_outputs, environment, save_figure, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_time(prompt: str, new: int, temperature: float, seed: int) -> dict:
    """One CLI run: its speculative run's prefill + decode (after its warm-up runs), and its token ids."""
    cmd = [sys.executable, "-m", "diffspec_jax.generate", "--prompt", prompt, "--max-new-tokens", str(new),
           "--ignore-eos", "--json", "--temperature", str(temperature), "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rep = json.loads(out.stdout)
    st = rep["stats"]
    return {"s": st["prefill_s"] + st["decode_s"], "ids": rep["ids"]}


def server_time(client: httpx.Client, url: str, prompt: str, new: int, temperature: float, seed: int) -> dict:
    """One request's time from send to full response, and its completion's token count."""
    body = {"model": "diffspec-demo", "prompt": prompt, "max_tokens": new, "ignore_eos": True,
            "temperature": temperature, "seed": seed}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    s = time.perf_counter() - t0
    r.raise_for_status()
    return {"s": s, "text": r.json()["choices"][0]["text"], "tokens": r.json()["usage"]["completion_tokens"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default="def main():")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--cli-runs", type=int, default=4, help="CLI processes per mode")
    ap.add_argument("--requests", type=int, default=12, help="server requests per mode (after 2 untimed)")
    add_output_arguments(ap, "benchmarks/results/cpu_first_request.json")
    args = ap.parse_args(argv)
    out_json, out_png = claim_outputs(ap, args, [args.out, str(Path(args.out).with_suffix(".png"))], __file__)
    port = _free_port()
    srv = subprocess.Popen([sys.executable, "-m", "diffspec_jax.serve", "--port", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = []
    try:
        for line in srv.stdout:
            banner.append(line.rstrip())
            if "listening on" in line:
                break
        url = f"http://127.0.0.1:{port}"
        modes = {"greedy": 0.0, "sampled": 1.0}
        res = {}
        with httpx.Client(timeout=120) as client:
            for name, temp in modes.items():
                cli = [cli_time(args.prompt, args.max_new_tokens, temp, seed) for seed in range(1, args.cli_runs + 1)]
                for seed in (1, 2):
                    server_time(client, url, args.prompt, args.max_new_tokens, temp, seed)  # untimed
                srv_runs = [server_time(client, url, args.prompt, args.max_new_tokens, temp,
                                        1 + i % args.cli_runs) for i in range(args.requests)]
                c, s = statistics.median(r["s"] for r in cli), statistics.median(r["s"] for r in srv_runs)
                res[name] = {"temperature": temp, "cli_s": [r["s"] for r in cli],
                             "server_s": [r["s"] for r in srv_runs],
                             "cli_median_s": c, "server_median_s": s, "server_over_cli": s / c,
                             "server_tokens": sorted({r["tokens"] for r in srv_runs})}
                print(f"{name}: CLI median {c:.3f} s, server median {s:.3f} s, ratio {s / c:.2f}", flush=True)
    finally:
        srv.terminate()
        srv.wait(60)
    payload = {"environment": environment(sys.argv), "prompt": args.prompt,
               "max_new_tokens": args.max_new_tokens, "server_banner": banner, "modes": res}
    write_json(out_json, payload)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(res)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res[n]["cli_median_s"] for n in names], 0.4, label="CLI (prefill + decode)")
    ax.bar([i + 0.2 for i in x], [res[n]["server_median_s"] for n in names], 0.4, label="server (HTTP, client-timed)")
    for i, n in enumerate(names):
        ax.text(i + 0.2, res[n]["server_median_s"], f"{res[n]['server_over_cli']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), names)
    ax.set_ylabel(f"seconds for {args.max_new_tokens} tokens (median)")
    ax.set_title(f"no-argument server vs CLI, {payload['environment']['device']}", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, out_png)


if __name__ == "__main__":
    main()
