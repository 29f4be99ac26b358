"""Load on the OpenAI-compatible server: N concurrent streaming clients, Poisson arrivals, mixed prompt lengths;
time to first token, inter-token latency and output tokens/s, beside an offline ``generate()`` of the same
requests in batches of N.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load_h200 --clients 8 --requests 32 \\
        --prompt-lens 2048,8192,32768,65536 --new-tokens 256 --policies target-only,recent,diffspec
    python benchmarks/serve_load.py --quick --out /tmp/serve_load          # tiny shapes on a CPU (a smoke test)
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --api-key KEY --out /tmp/load   # a running server

Without ``--url``, per policy a child process builds a Llama-3.1-8B-shaped target and an EAGLE-3-shaped draft
with **random bfloat16 weights** (``benchmarks/long_context.py``'s models; tiny ones with ``--quick``): timings are
real, acceptance is meaningless (a random draft accepts almost nothing, so speculative policies run at about one
token per cycle). The child first runs the offline baseline, ``generate()`` on the same requests in batches of
``--clients`` (a warm-up call compiles first; ``wall - compile_s`` is timed), frees it, then serves the requests
with :class:`diffspec_jax.serving.SlotEngine` behind uvicorn (``max_num_seqs = --clients``, ``max_model_len`` =
the longest prompt + ``--new-tokens``) and a stand-in tokenizer whose text is the token ids, so the load
generator counts tokens per streamed chunk. The load generator is this (parent) process, which never touches the
accelerator: no client competes with the server for the GIL.

Requests arrive as a Poisson process of ``--rate`` requests per second (0: all at once) and are sent by at most
``--clients`` concurrent clients (each request waits for a free client), each a stream of prompt ids,
``max_tokens = --new-tokens``, greedy, ``ignore_eos``. Per request: TTFT (send -> first token), the gaps between
streamed chunks, and per token the inter-token latency (a chunk's gap spread over its tokens); server output
tokens/s = all completion tokens / (last token - first send). The server streams once per device block, so tokens
arrive in bursts of up to ``--block-cycles`` cycles' tokens: both the per-chunk gaps and the per-token latency are
reported, with their p99 / p50 (:data:`DEFINITIONS`, also written into the JSON). ``/metrics`` is read before and
after: ``compiles_after_warmup`` must stay 0. Against ``--url`` only the load runs (tokens per chunk are unknown
there: chunk gaps, TPOT and usage counts are reported).

Time: each policy's child builds its models, runs the offline baseline, compiles the server's programs and serves
the load. ``--policy-timeout-s`` kills a child past its limit (the run records the error, the next policy
starts); ``--time-budget-s`` starts no further policy once the run is past the budget or would be by the mean
time of the policies so far, and caps each policy's limit at what remains (the JSON lists ``skipped`` policies).
``serve_load.json`` is rewritten after every policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLICIES = ("target-only", "recent", "diffspec")
#: issue 24's targets (8 concurrent clients on the H200)
TARGET_THROUGHPUT_RATIO, TARGET_ITL_P99_OVER_P50 = 0.9, 2.0
CHILD_PREFIX = "SERVE_LOAD "
#: what each figure of serve_load.json means (written into it)
DEFINITIONS = {
    "ttft": "per request: send -> its first streamed token",
    "chunk_gap": "per streamed chunk after a request's first: the time since the request's previous chunk. The server "
                 "streams a request's tokens once per device block (up to block_cycles verification cycles), so this "
                 "is the time between blocks as a client sees it",
    "itl": "per token after a request's first: its chunk's gap divided by the chunk's tokens (every token of a chunk "
           "gets the same value; percentiles weigh chunks by their tokens). Needs the ids-as-text tokenizer (not "
           "with --url)",
    "tokens_per_chunk": "mean tokens per streamed chunk after the first",
    "p99_over_p50": "p99 / p50 of the same figure (issue 24's target: itl <= 2)",
    "tpot": "per request: (last token - first token) / (tokens - 1)",
    "server tokens/s": "all completion tokens / (the last token - the first send)",
    "offline tokens/s": "new tokens / sum over batches of (wall - compile_s) of generate() on the same requests in "
                        "batches of --clients, after a warm-up call (compilation excluded on both sides: the server "
                        "compiles at its warm-up, before the load, and /metrics counts any compile after it)",
    "throughput_vs_offline": "server tokens/s / offline tokens/s (issue 24's target: >= 0.9)"}


# ------------------------------------------------------------------------------------------ requests
def make_requests(args, vocab: int) -> list[list[int]]:
    """``--requests`` prompts of random ids, lengths cycling through ``--prompt-lens`` in a shuffled order."""
    rng = np.random.default_rng(args.seed)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    order = rng.permutation(np.resize(lens, args.requests))
    return [rng.integers(1, vocab, int(n)).tolist() for n in order]


def arrivals(args) -> np.ndarray:
    """Send times (seconds from the start): a Poisson process of ``--rate`` per second, or all at 0."""
    if args.rate <= 0:
        return np.zeros(args.requests)
    gaps = np.random.default_rng(args.seed + 1).exponential(1.0 / args.rate, args.requests)
    return np.cumsum(gaps) - gaps[0]


def pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else None


# ------------------------------------------------------------------------------------------ load generator
async def _one(client, url, headers, prompt, args, t0, at, sem) -> dict:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    async with sem:
        body = {"prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if args.model:
            body["model"] = args.model
        sent = time.perf_counter()
        chunks, usage, error = [], None, None
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"]
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    if ch.get("text"):
                        chunks.append((time.perf_counter(), ch["text"]))
        return {"sent": sent - t0, "chunks": [(t - t0, text) for t, text in chunks], "usage": usage, "error": error,
                "prompt_tokens": len(prompt)}


async def _load(url: str, prompts, args) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*[_one(client, url, headers, p, args, t0, at, sem)
                                      for p, at in zip(prompts, arrivals(args))])


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _spread(xs) -> dict:
    return {"p50": pct(xs, 50), "p99": pct(xs, 99), "p99_over_p50": ratio(pct(xs, 99), pct(xs, 50))}


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: list[dict], ids_text: bool) -> dict:
    """TTFT, chunk gaps, per-token inter-token latency (``ids_text``: the text is the ids, so tokens per chunk are
    known), TPOT and output tokens/s of one load run (definitions: :data:`DEFINITIONS`)."""
    ok = [r for r in results if not r.get("error") and r.get("chunks")]
    ttft, gaps, itl, tpot, per_chunk, tokens = [], [], [], [], [], 0
    first_send = min((r["sent"] for r in ok), default=0.0)
    last = max((r["chunks"][-1][0] for r in ok), default=0.0)
    for r in ok:
        times = [t for t, _ in r["chunks"]]
        ttft.append(times[0] - r["sent"])
        n = r["usage"]["completion_tokens"] if r.get("usage") else None
        if ids_text:
            counts = [text.count(" ") for _, text in r["chunks"]]
            n = sum(counts)
            per_chunk += counts[1:]
            for (t_prev, t), c in zip(zip(times, times[1:]), counts[1:]):
                itl += [(t - t_prev) / c] * c
        gaps += list(np.diff(times))
        tokens += n or 0
        if n and n > 1:
            tpot.append((times[-1] - times[0]) / (n - 1))
    span = last - first_send
    return {"requests": len(results), "completed": len(ok), "errors": [r.get("error") for r in results
                                                                      if r.get("error")][:5],
            "output_tokens": tokens, "span_s": span, "output_tokens_per_s": tokens / span if span > 0 else None,
            "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "mean": float(np.mean(ttft)) if ttft else None},
            "chunk_gap_s": _spread(gaps), "itl_s": _spread(itl) if ids_text else None,
            "tokens_per_chunk": float(np.mean(per_chunk)) if per_chunk else None, "tpot_s": _spread(tpot)}


def run_load(url: str, prompts, args, ids_text: bool) -> dict:
    before = scrape(url)
    t = time.perf_counter()
    results = asyncio.run(_load(url, prompts, args))
    wall = time.perf_counter() - t
    after = scrape(url)
    keys = ("diffspec_compiles_after_warmup", "diffspec_xla_compiles_after_warmup", "diffspec_program_compiles_total")
    out = summarize(results, ids_text)
    out["wall_s"] = wall
    out["metrics"] = {k: after.get(k) for k in keys}
    out["metrics"]["mean_acceptance_length"] = next((v for k, v in after.items()
                                                      if k.startswith("diffspec_mean_acceptance_length")), None)
    out["metrics"]["retrievals"] = sum(v - before.get(k, 0.0) for k, v in after.items()
                                       if k.startswith("diffspec_retrievals_total"))
    for key in ("gc_full_collections_total", "gc_pause_seconds_total"):  # during the load
        out["metrics"][key] = after.get(f"diffspec_{key}", 0.0) - before.get(f"diffspec_{key}", 0.0)
    out["metrics"]["gc_pause_seconds_max"] = after.get("diffspec_gc_pause_seconds_max")
    return out


# ------------------------------------------------------------------------------------------ the child
class IdsTokenizer:
    """A stand-in tokenizer for random weights: the text of ids is the ids (``"12 7 "``), so every prefix's text is
    a prefix of the whole and the load generator counts tokens per chunk."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"{int(i)} " for i in ids)


def _models(args):
    from benchmarks import long_context as lc
    from diffspec_jax.draft import DraftModel

    tcfg, dcfg = lc.shapes(args.quick)
    target = lc.random_target(tcfg)
    draft = DraftModel(config=dcfg, params=lc.random_draft(dcfg, target), aux_layers=dcfg.resolve_aux_layers(tcfg))
    return target, draft


def _spec(policy: str, args):
    from diffspec_jax.config import SpecConfig

    return SpecConfig.from_flat(dict(num_speculative_tokens=args.k,
                                     draft_context_policy="full" if policy == "target-only" else policy,
                                     diffspec_token_budget=args.budget, diffspec_chunk_size=args.chunk))


def offline(target, draft, prompts, args) -> dict:
    """``generate()`` on the requests in batches of ``--clients``: a warm-up call, then every batch timed.

    Every call gets the cache capacity ``generate()`` picks for the longest prompt of all (so the batches share
    their programs). The warm-up compiles those programs on the first batch cut to two prefill chunks and two new
    tokens (what remains to compile in a timed call is in its ``compile_s``, subtracted)."""
    import gc

    from diffspec_jax import generate
    from diffspec_jax.engine.compile import capacity_bucket
    from diffspec_jax.target import plan_prefill

    spec = _spec(args.policy, args)
    k = spec.num_speculative_tokens if draft is not None else 0
    tc = target.config
    cap = capacity_bucket(max(map(len, prompts)) + args.new_tokens + k + 1, tc.max_position_embeddings + k + 1)
    kw = dict(stop_token_ids=(), spec=spec, max_cache_len=cap)
    batches = [prompts[i:i + args.clients] for i in range(0, len(prompts), args.clients)]
    width, _ = plan_prefill([len(p) for p in batches[0]], None)
    generate(target, draft, [p[:width + 1] for p in batches[0]], max_new_tokens=2, **kw)
    kw["max_new_tokens"] = args.new_tokens
    tokens, busy, compile_s, rows = 0, 0.0, 0.0, []
    for b in batches:
        t = time.perf_counter()
        res = generate(target, draft, b, **kw)
        wall = time.perf_counter() - t
        tokens += res.stats.new_tokens
        busy += wall - res.stats.compile_s
        compile_s += res.stats.compile_s
        rows.append({"batch": len(b), "max_prompt": max(map(len, b)), "wall_s": wall, "compile_s": res.stats.compile_s,
                     "ttft_s": res.stats.ttft_s, "decode_s": res.stats.decode_s})
        del res
        gc.collect()
    return {"output_tokens": tokens, "busy_s": busy, "compile_s": compile_s,
            "output_tokens_per_s": tokens / busy if busy > 0 else None, "batches": rows}


def child(args) -> int:
    """Offline baseline, then the server on ``--port`` until terminated (reports on stdout)."""
    import gc

    import uvicorn

    from diffspec_jax.serving.app import create_app
    from diffspec_jax.serving.scheduler import EngineConfig, SlotEngine

    target, draft = _models(args)
    if args.policy == "target-only":
        draft = None
    prompts = make_requests(args, target.config.vocab_size)
    print(CHILD_PREFIX + json.dumps({"offline": offline(target, draft, prompts, args)}), flush=True)
    gc.collect()
    max_len = max(map(len, prompts)) + args.new_tokens
    engine = SlotEngine(target, draft, _spec(args.policy, args),
                        EngineConfig(max_num_seqs=args.clients, max_model_len=max_len,
                                     prefill_chunk=args.prefill_chunk, block_cycles=args.block_cycles,
                                     max_prefill_per_block=args.max_prefill_per_block,
                                     request_timeout=args.timeout_s))
    t = time.perf_counter()
    engine.start()
    from benchmarks.common import environment

    info = {"warmup_s": time.perf_counter() - t, "compiles": engine.compiles, "compile_s": engine.clock.seconds,
            "capacity": engine.capacity, "prefill_chunk": engine.prefill_chunk, "block_cycles": engine.block_cycles,
            "prefill_chunks_per_block": engine.chunks_per_block,
            "environment": environment(sys.argv)}
    app = create_app(engine, IdsTokenizer(), model_name="bench")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.1)
    print(CHILD_PREFIX + json.dumps({"ready": info}), flush=True)
    sys.stdin.read()  # the parent closes stdin when it is done
    server.should_exit = True
    thread.join(60)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_policy(policy: str, args, limit_s: float | None = None) -> dict:
    """One child for ``policy``: its offline baseline, then the load against its server. ``limit_s``: the child
    is killed past this many seconds (the run then has ``error`` and what it had measured)."""
    port = _free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--policy", policy, "--port", str(port)]
    for key in ("clients", "requests", "prompt_lens", "new_tokens", "seed", "k", "budget", "chunk", "timeout_s"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key in ("prefill_chunk", "block_cycles", "max_prefill_per_block"):
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    out: dict = {"policy": policy}
    t0 = time.perf_counter()
    watchdog = None
    if limit_s is not None:
        def kill():
            out["error"] = f"killed after the policy's time limit ({limit_s:.0f} s)"
            proc.kill()
        watchdog = threading.Timer(limit_s, kill)
        watchdog.daemon = True
        watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(CHILD_PREFIX):
                out.update(json.loads(line[len(CHILD_PREFIX):]))
                if "ready" in out:
                    break
        if "ready" not in out:
            out.setdefault("error", f"the {policy} child exited ({proc.wait()}) before serving")
        else:
            from benchmarks.long_context import shapes

            prompts = make_requests(args, shapes(args.quick)[0].vocab_size)
            out["server"] = run_load(f"http://127.0.0.1:{port}", prompts, args, ids_text=True)
    except Exception as exc:  # noqa: BLE001  (the child killed mid-load: keep the other policies' results)
        out.setdefault("error", f"{type(exc).__name__}: {exc}")
    finally:
        if watchdog is not None:
            watchdog.cancel()
        proc.stdin.close()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    out["wall_s"] = time.perf_counter() - t0
    off = out.get("offline", {}).get("output_tokens_per_s")
    srv = out.get("server", {}).get("output_tokens_per_s")
    out["throughput_vs_offline"] = ratio(srv, off)
    out["itl_p99_over_p50"] = (out.get("server", {}).get("itl_s") or {}).get("p99_over_p50")
    out["chunk_gap_p99_over_p50"] = (out.get("server", {}).get("chunk_gap_s") or {}).get("p99_over_p50")
    return out


# ------------------------------------------------------------------------------------------ report
def plot(payload: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in payload["runs"] if r.get("server")]
    if not runs:
        return None
    names = [r["policy"] for r in runs]
    x = np.arange(len(runs))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    srv = [r["server"]["output_tokens_per_s"] or 0 for r in runs]
    off = [(r.get("offline") or {}).get("output_tokens_per_s") or 0 for r in runs]
    a.bar(x - 0.2, srv, 0.4, label="server (streaming clients)")
    a.bar(x + 0.2, off, 0.4, label=f"offline generate(), batch {payload['settings']['clients']}")
    a.set_xticks(x, names)
    a.set_ylabel("output tokens / s")
    a.legend(fontsize=8)
    a.set_title("throughput")
    width = 0.2
    for i, (key, q) in enumerate([("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99")]):
        vals = [((r["server"].get(key) or {}).get(q) or 0) * 1e3 for r in runs]
        b.bar(x + (i - 1.5) * width, vals, width, label=f"{key[:-2]} {q}")
    b.set_xticks(x, names)
    b.set_yscale("log")
    b.set_ylabel("ms")
    b.legend(fontsize=8)
    b.set_title("latency")
    s = payload["settings"]
    fig.suptitle(f"{s['clients']} clients, {s['requests']} requests, prompts {s['prompt_lens']}, {s['new_tokens']} new "
                 f"tokens, rate {s['rate'] or 'all at once'}" + (" (random weights)" if not s.get("url") else ""),
                 fontsize=9)
    from benchmarks.common import save_figure

    return save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (only the load runs)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="the model name to send (--url)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {POLICIES}")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    ap.add_argument("--prompt-lens", default="2048,8192,32768,65536")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--block-cycles", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prefill-per-block", type=int, default=None,
                    help="the server's prompt tokens between two decode blocks while slots decode (default one chunk)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per request (server and client)")
    ap.add_argument("--policy-timeout-s", type=float, default=0.0,
                    help="kill a policy's child after this many seconds (0: no limit)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="start no further policy once the run is past this many seconds, or would be by the mean "
                         "time of the policies run so far; each policy's time limit is at most what remains (0: none)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a small load (CPU smoke test)")
    ap.add_argument("--out", default=None, help="output directory: serve_load.json and serve_load.png (required)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a serve_load.json / serve_load.png in --out that no diffspec tool wrote (moved to "
                         "NAME.replaced-<time>, nothing is deleted)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.quick:  # small defaults for what the command line leaves at its defaults
        defaults = parser().parse_args([])
        for key, value in (("clients", 4), ("requests", 8), ("prompt_lens", "64,256,512"), ("new_tokens", 64),
                           ("budget", 64), ("chunk", 16), ("prefill_chunk", 32)):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    if args.child:
        return child(args)
    if not args.out:
        parser().error("--out DIR is required")
    from benchmarks.common import claim_outputs, write_json

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser().error(f"--out {out} exists and is not a directory; give a directory (it receives serve_load.json "
                       f"and serve_load.png)")
    result, figure = claim_outputs(parser(), args, [out / "serve_load.json", out / "serve_load.png"], __file__)
    payload = {"benchmark": "serve_load: OpenAI server under concurrent streaming clients vs offline generate()",
               "settings": vars(args), "runs": [],
               "definitions": DEFINITIONS,
               "targets": {"throughput_vs_offline": TARGET_THROUGHPUT_RATIO,
                           "itl_p99_over_p50": TARGET_ITL_P99_OVER_P50}}
    if args.url:
        prompts = make_requests(args, 256)
        payload["note"] = "against a running server: prompts are random ids below 256; tokens per chunk unknown"
        payload["runs"].append({"policy": "url", "server": run_load(args.url.rstrip("/"), prompts, args,
                                                                    ids_text=False)})
    else:
        from benchmarks.long_context import RANDOM_NOTE

        payload["note"] = RANDOM_NOTE + ("; tiny shapes (--quick)" if args.quick else
                                         "; Llama-3.1-8B-shaped target, EAGLE-3-shaped draft")
        policies = args.policies.split(",")
        for policy in policies:
            if policy not in POLICIES:
                parser().error(f"--policies takes names of {POLICIES}, got {policy!r}")
        t0 = time.perf_counter()
        for policy in policies:
            limit = args.policy_timeout_s or None
            if args.time_budget_s:
                spent = time.perf_counter() - t0
                mean = spent / len(payload["runs"]) if payload["runs"] else 0.0
                if spent + mean > args.time_budget_s:
                    payload.setdefault("skipped", []).append(policy)
                    print(f"skipping {policy}: {spent:.0f} s spent of --time-budget-s {args.time_budget_s:g}"
                          f" (mean {mean:.0f} s per policy)", flush=True)
                    continue
                limit = min(limit or np.inf, args.time_budget_s - spent)
            payload["runs"].append(run_policy(policy, args, limit))
            write_json(result, payload)
    write_json(result, payload)
    png = plot(payload, figure)
    for r in payload["runs"]:
        s = r.get("server") or {}
        print(json.dumps({"policy": r["policy"], "server_tok_s": s.get("output_tokens_per_s"),
                          "offline_tok_s": (r.get("offline") or {}).get("output_tokens_per_s"),
                          "ratio": r.get("throughput_vs_offline"), "ttft": s.get("ttft_s"), "itl": s.get("itl_s"),
                          "metrics": s.get("metrics"), **({"error": r["error"]} if r.get("error") else {})}))
    print(f"wrote {out / 'serve_load.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
