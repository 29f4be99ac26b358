"""Load on the OpenAI-compatible server: N concurrent streaming clients, Poisson arrivals, mixed prompt lengths;
time to first token, inter-token latency and output tokens/s, beside an offline ``generate()`` of the same
requests in batches of N.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load_h200 --clients 8 --requests 32 \\
        --prompt-lens 2048,8192,32768,65536 --new-tokens 256 --policies target-only,recent,diffspec
    python benchmarks/serve_load.py --quick --out /tmp/serve_load          # tiny shapes on a CPU (a smoke test)
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --api-key KEY --out /tmp/load   # a running server
    python benchmarks/serve_load.py --workloads shared-doc,capacity --out /tmp/paging       # issue 37 (below)

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

``--workloads`` (default ``load``, the above) adds two workloads of issue 37 (paged K/V, prefix caching), each on
servers of its own, without the offline baseline (benchmarks/README.md lists every key they write):

* ``shared-doc``: per ``--shared-policies`` policy a server with prefix caching on and one with it off; per
  ``--doc-lens`` document, clients asking their own questions about it: the first alone, the others one at a
  time (each hit's TTFT against the first's, its cached tokens against the document's full pages), then every
  client's follow-up turn at once (prompt + answer + a new message: does it hit every full page of the previous
  turn?). :func:`shared_document`, :func:`shared_summary`, :func:`compare_shared`.
* ``capacity``: mixed 2K-64K prompts all sent at once to a server of ``--capacity-seqs`` sequences over a page
  pool and to one with the same pool but as many sequences as fixed ``--capacity-max-model-len`` slots would
  hold: requests decoding at once (:func:`decoding_concurrency`), tokens/s, ITL, compiles after warm-up,
  preemptions. :func:`run_capacity`, :func:`compare_capacity`.

The child serves two routes of its own beside the OpenAI ones: ``/bench/engine`` (``SlotEngine.metrics()``) and
``/bench/cached`` (a finished request's ``cached_tokens``, for servers whose usage does not report it, its
preemptions and its timeline in the engine: admitted, prefilled, started, first token).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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

#: ``self-*``: the target drafts for itself (``--draft self``) over the named working set
POLICIES = ("target-only", "recent", "diffspec", "self-recent", "self-diffspec")
SELF_PREFIX = "self-"
WORKLOADS = ("load", "shared-doc", "capacity", "pressure")
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


def arrivals(args, n: int) -> np.ndarray:
    """Send times of ``n`` requests (seconds from the start): a Poisson process of ``--rate`` per second, or all
    at 0."""
    if args.rate <= 0:
        return np.zeros(n)
    gaps = np.random.default_rng(args.seed + 1).exponential(1.0 / args.rate, n)
    return np.cumsum(gaps) - gaps[0]


def pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else None


# ------------------------------------------------------------------------------------------ load generator
async def _stream(client, url, headers, prompt, max_tokens: int, args, t0: float) -> dict:
    """One greedy streaming completion of ``prompt`` (ids, ``ignore_eos``): its send time and chunks (seconds from
    ``t0``), its usage and error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
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


async def _one(client, url, headers, prompt, args, t0, at, sem) -> dict:
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    async with sem:
        return await _stream(client, url, headers, prompt, args.new_tokens, args, t0)


async def _load(url: str, prompts, args) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*[_one(client, url, headers, p, args, t0, at, sem)
                                      for p, at in zip(prompts, arrivals(args, len(prompts)))])


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


def decoding_concurrency(results: list[dict]) -> dict:
    """Requests decoding at once, as the clients see it: a request decodes from its first streamed token to its
    last. ``peak``; ``mean``, weighted by time over the window from the first first token to the last token;
    ``series``: ``[time, requests]`` after every change (seconds from the load's start)."""
    spans = [(r["chunks"][0][0], r["chunks"][-1][0]) for r in results if not r.get("error") and r.get("chunks")]
    deltas: dict[float, int] = {}
    for a, b in spans:
        if b > a:  # a request streamed in one chunk never decodes alongside another
            deltas[a] = deltas.get(a, 0) + 1
            deltas[b] = deltas.get(b, 0) - 1
    if not deltas:
        return {"peak": 0, "mean": 0.0, "window_s": 0.0, "series": []}
    times = sorted(deltas)
    n, peak, area, series = 0, 0, 0.0, []
    for t_prev, t in zip([times[0]] + times, times):
        area += n * (t - t_prev)
        n += deltas[t]
        peak = max(peak, n)
        series.append([t, n])
    window = times[-1] - times[0]
    return {"peak": peak, "mean": area / window if window > 0 else float(peak), "window_s": window, "series": series}


def summarize(results: list[dict], ids_text: bool) -> dict:
    """TTFT, chunk gaps, per-token inter-token latency (``ids_text``: the text is the ids, so tokens per chunk are
    known), TPOT, output tokens/s and requests decoding at once of one load run (definitions:
    :data:`DEFINITIONS`)."""
    ok = {i: r for i, r in enumerate(results) if not r.get("error") and r.get("chunks")}  # by request index
    ttft, gaps, itl, tpot, per_chunk, tokens, where = [], [], [], [], [], 0, []
    first_send = min((r["sent"] for r in ok.values()), default=0.0)
    last = max((r["chunks"][-1][0] for r in ok.values()), default=0.0)
    for i, r in ok.items():
        times = [t for t, _ in r["chunks"]]
        ttft.append(times[0] - r["sent"])
        n = r["usage"]["completion_tokens"] if r.get("usage") else None
        if ids_text:
            counts = [text.count(" ") for _, text in r["chunks"]]
            n = sum(counts)
            per_chunk += counts[1:]
            for j, ((t_prev, t), c) in enumerate(zip(zip(times, times[1:]), counts[1:])):
                itl += [(t - t_prev) / c] * c
                where.append((i, j + 1, len(times), c, t - t_prev, t_prev - first_send))
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
            "tokens_per_chunk": float(np.mean(per_chunk)) if per_chunk else None, "tpot_s": _spread(tpot),
            "decoding_at_once": decoding_concurrency(results), "itl_outliers": _itl_outliers(where, itl)}


def _itl_outliers(where: list[tuple], itl: list[float], over: float = 1.5, keep: int = 40) -> dict | None:
    """The streamed chunks whose per-token ITL exceeds ``over`` x the median (what sets the p99): how many, and
    the first ``keep`` as ``[request, chunk index, chunks in the request, tokens, gap s, sent at s since the
    load's first send]``."""
    if not itl:
        return None
    cut = over * pct(itl, 50)
    rows = [list(w) for w in where if w[4] / w[3] > cut]
    return {"over_median": over, "chunks": len(rows), "of": len(where),
            "tokens": int(sum(w[3] for w in rows)), "first": rows[:keep]}


def engine_snapshot(url: str) -> dict | None:
    """The engine's own metrics (``SlotEngine.metrics()``) from a server this script started (``/bench/engine``);
    ``None`` from any other server."""
    import httpx

    r = httpx.get(f"{url}/bench/engine", timeout=30)
    return r.json() if r.status_code == 200 else None


def paging_counts(before: dict | None, after: dict | None) -> dict | None:
    """What the load did to the page pool (from :func:`engine_snapshot`\ s): prefix-cache queries and hits (tokens),
    preemptions, and the pool's pages at the end (used, cached, total)."""
    if not before or not after:
        return None
    delta = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits, "prefix_hit_rate": ratio(hits, queries),
            "preemptions": delta("total_preemptions"), "replayed_tokens": delta("total_replayed_tokens"),
            "replay_mismatches": delta("total_replay_mismatches"), "kv_blocks_used_after": after.get("kv_blocks_used"),
            "kv_blocks_cached_after": after.get("kv_blocks_cached"), "kv_blocks_total": after.get("kv_blocks_total"),
            "prefix_caching": after.get("prefix_caching")}


def run_load(url: str, prompts, args, ids_text: bool, keep_answers: bool = False) -> dict:
    """The load of ``prompts`` against ``url``: :func:`summarize`'s figures, metrics, paging counts, and with
    ``keep_answers`` each request's answer (its ids, ids-as-text tokenizer) in ``answers``."""
    before, engine_before = scrape(url), engine_snapshot(url)
    t = time.perf_counter()
    results = asyncio.run(_load(url, prompts, args))
    wall = time.perf_counter() - t
    after, engine_after = scrape(url), engine_snapshot(url)
    if engine_after is not None:  # the pool once the engine is idle (its last request may still be leaving)
        deadline = time.monotonic() + 30
        while engine_after.get("requests_running") and time.monotonic() < deadline:
            time.sleep(0.2)
            engine_after = engine_snapshot(url)
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
    out["paging"] = paging_counts(engine_before, engine_after)
    if keep_answers:
        out["answers"] = [None if r.get("error") else text_ids("".join(t for _, t in r["chunks"])) for r in results]
    return out


# ------------------------------------------------------------------------------------------ the child
class IdsTokenizer:
    """A stand-in tokenizer for random weights: the text of ids is the ids (``"12 7 "``), so every prefix's text is
    a prefix of the whole and the load generator counts tokens per chunk."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"{int(i)} " for i in ids)


def text_ids(text: str) -> list[int]:
    """The ids of an :class:`IdsTokenizer` text."""
    return [int(x) for x in text.split()]


def prompt_key(ids) -> str:
    """A request's key between the load generator and the child: sha256 of its prompt ids (int32)."""
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()


def _models(args):
    from benchmarks import long_context as lc
    from diffspec_jax.draft import DraftModel

    tcfg, dcfg = lc.shapes(args.quick)
    target = lc.random_target(tcfg)
    draft = DraftModel(config=dcfg, params=lc.random_draft(dcfg, target), aux_layers=dcfg.resolve_aux_layers(tcfg))
    return target, draft


def _spec(policy: str, args):
    from diffspec_jax.config import SpecConfig

    policy = policy.removeprefix(SELF_PREFIX)
    return SpecConfig.from_flat(dict(num_speculative_tokens=args.k,
                                     draft_context_policy="full" if policy == "target-only" else policy,
                                     diffspec_token_budget=args.budget, diffspec_chunk_size=args.chunk,
                                     deterministic=args.deterministic))


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


def reference_alone(target, draft, prompts, args) -> dict:
    """``generate()`` on each prompt alone (greedy, ``--new-tokens``, no stop ids, the server's prefill chunk
    width): ``{"tokens": [...], "wall_s"}``, what every completed server request must return."""
    from diffspec_jax import generate
    from diffspec_jax.engine.compile import capacity_bucket

    spec = _spec(args.policy, args)
    k = spec.num_speculative_tokens if draft is not None else 0
    tc = target.config  # one capacity for every prompt: one set of programs
    cap = capacity_bucket(max(map(len, prompts)) + args.new_tokens + k + 1, tc.max_position_embeddings + k + 1)
    t = time.perf_counter()
    width = engine_config(args, cap).prefill_width()
    tokens = [generate(target, draft, [p], max_new_tokens=args.new_tokens, spec=spec, stop_token_ids=(),
                       max_cache_len=cap, prefill_chunk=width).tokens[0] for p in prompts]
    return {"tokens": [list(map(int, x)) for x in tokens], "wall_s": time.perf_counter() - t}


def engine_config(args, max_model_len: int):
    """The child's :class:`EngineConfig`: ``--max-num-seqs`` slots (default ``--clients``), the page pool's
    options (``--block-size``, ``--num-kv-blocks``, ``--kv-cache-memory-fraction``, ``--no-prefix-caching``,
    ``--kv-cache-dtype``)."""
    from diffspec_jax.serving.scheduler import EngineConfig

    pool = {"kv_cache_memory_fraction": args.kv_cache_memory_fraction} if args.kv_cache_memory_fraction else {}
    return EngineConfig(max_num_seqs=args.max_num_seqs or args.clients, max_model_len=max_model_len,
                        prefill_chunk=args.prefill_chunk, block_cycles=args.block_cycles,
                        max_prefill_per_block=args.max_prefill_per_block, request_timeout=args.timeout_s,
                        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype, **pool)


def _bench_routes(app, engine) -> None:
    """Two routes for this script's load generator (a server it started, nothing a user runs): ``/bench/engine``,
    the engine's metrics as JSON, and ``/bench/cached?key=K``, the ``cached_tokens``, preemptions and timeline
    (``since_arrival_s``) of the finished request whose :func:`prompt_key` is ``K`` (recorded from its finish
    event; 404 while there is none)."""
    from fastapi.responses import JSONResponse

    cached: dict[str, int] = {}
    submit = engine.submit

    def recording(req):
        key, sink = prompt_key(req.prompt_ids), req.sink

        def sink_and_record(ev):
            if ev.kind == "finish":
                marks = {**req.marks, "first_token": req.first_token_at}
                cached[key] = {"cached_tokens": int(ev.cached_tokens), "preemptions": req.preemptions,
                               "since_arrival_s": {k: v - req.arrival for k, v in marks.items() if v is not None}}
            sink(ev)

        req.sink = sink_and_record
        submit(req)

    engine.submit = recording

    @app.get("/bench/engine")
    async def bench_engine():
        return JSONResponse(json.loads(json.dumps(engine.metrics(), default=float)))

    @app.get("/bench/cached")
    async def bench_cached(key: str):
        if key not in cached:
            return JSONResponse({"error": "no finished request with this prompt"}, status_code=404)
        return cached[key]


def child(args) -> int:
    """Offline baseline (unless ``--no-offline``), then the server on ``--port`` until terminated (reports on
    stdout)."""
    import gc

    import uvicorn

    from diffspec_jax.serving.app import create_app
    from diffspec_jax.serving.scheduler import SlotEngine

    target, draft = _models(args)
    if args.policy == "target-only":
        draft = None
    elif args.policy.startswith(SELF_PREFIX):
        draft = "self"
    prompts = make_requests(args, target.config.vocab_size)
    if args.reference_alone:
        print(CHILD_PREFIX + json.dumps({"reference": reference_alone(target, draft, prompts, args)}), flush=True)
        gc.collect()
    if not args.no_offline:
        print(CHILD_PREFIX + json.dumps({"offline": offline(target, draft, prompts, args)}), flush=True)
        gc.collect()
    max_len = args.max_model_len or max(map(len, prompts)) + args.new_tokens
    engine = SlotEngine(target, draft, _spec(args.policy, args), engine_config(args, max_len))
    t = time.perf_counter()
    engine.start()
    from benchmarks.common import environment

    info = {"warmup_s": time.perf_counter() - t, "compiles": engine.compiles, "compile_s": engine.clock.seconds,
            "capacity": engine.capacity, "prefill_chunk": engine.prefill_chunk, "block_cycles": engine.block_cycles,
            "prefill_chunks_per_block": engine.chunks_per_block, "max_num_seqs": engine.num_slots,
            "max_model_len": engine.max_model_len, "block_size": engine.page_size, "num_kv_blocks": engine.num_pages,
            "pool_tokens": engine.num_pages * engine.page_size, "prefix_caching": engine.prefix_caching,
            "policy": engine.policy, "environment": environment(sys.argv)}
    app = create_app(engine, IdsTokenizer(), model_name="bench")
    _bench_routes(app, engine)
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


#: options passed on to every child, and those passed only when set
CHILD_OPTIONS = ("clients", "requests", "prompt_lens", "new_tokens", "seed", "k", "budget", "chunk", "timeout_s",
                 "block_size", "kv_cache_dtype")
CHILD_OPTIONAL = ("prefill_chunk", "block_cycles", "max_prefill_per_block", "num_kv_blocks",
                  "kv_cache_memory_fraction")


def serve(policy: str, args, extra: list[str], limit_s: float | None, body) -> dict:
    """Start a child serving ``policy`` (its options: this run's, then ``extra``), wait until it listens, run
    ``body(url, out)`` (which fills ``out``, starting with the child's reports: ``offline``, ``ready``), then stop
    it. ``limit_s``: the child is killed past this many seconds (``out`` then has ``error`` and what was measured)."""
    port = _free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--policy", policy, "--port", str(port)]
    for key in CHILD_OPTIONS:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for key in CHILD_OPTIONAL:
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.quick:
        cmd.append("--quick")
    if args.deterministic:
        cmd.append("--deterministic")
    proc = subprocess.Popen(cmd + extra, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=os.environ.copy())
    out: dict = {"policy": policy}
    t0 = time.perf_counter()
    watchdog = None
    if limit_s is not None:
        def kill():
            out["error"] = f"killed after the run's time limit ({limit_s:.0f} s)"
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
            body(f"http://127.0.0.1:{port}", out)
    except Exception as exc:  # noqa: BLE001  (the child killed mid-load: keep the other runs' results)
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
    return out


def run_policy(policy: str, args, limit_s: float | None = None) -> dict:
    """One child for ``policy``: its offline baseline, then the load against its server. ``limit_s``: the child
    is killed past this many seconds (the run then has ``error`` and what it had measured)."""
    def body(url, out):
        from benchmarks.long_context import shapes

        out["server"] = run_load(url, make_requests(args, shapes(args.quick)[0].vocab_size), args, ids_text=True)

    out = serve(policy, args, [], limit_s, body)
    out["workload"] = "load"
    off = out.get("offline", {}).get("output_tokens_per_s")
    srv = out.get("server", {}).get("output_tokens_per_s")
    out["throughput_vs_offline"] = ratio(srv, off)
    out["itl_p99_over_p50"] = (out.get("server", {}).get("itl_s") or {}).get("p99_over_p50")
    out["chunk_gap_p99_over_p50"] = (out.get("server", {}).get("chunk_gap_s") or {}).get("p99_over_p50")
    return out


# ------------------------------------------------------------------------------------------ shared document
def _turn(result: dict) -> dict:
    """One shared-document request's record: TTFT, the answer's ids (the ids-as-text tokenizer), its cached tokens
    as the response's usage reports them (``None`` when it does not)."""
    if result.get("error") or not result.get("chunks"):
        return {"error": result.get("error") or "no tokens", "prompt_tokens": result.get("prompt_tokens")}
    usage = result.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return {"ttft_s": result["chunks"][0][0] - result["sent"], "prompt_tokens": result["prompt_tokens"],
            "answer": text_ids("".join(text for _, text in result["chunks"])), "end_s": result["chunks"][-1][0],
            "cached_tokens": cached, "cached_source": "usage" if cached is not None else None}


async def shared_document(send, doc_len: int, clients: int, args, vocab: int) -> dict:
    """One shared-document workload: ``clients`` prompts ``document + question_i`` (random ids; the document of
    ``doc_len`` tokens shared, each question ``--question-len`` tokens of its own). ``first``: client 0 alone (no
    page of the document cached yet); ``hits``: clients 1.. one at a time (each request's TTFT alone); then
    ``followups``: every client at once sends its next turn, ``its prompt + its answer + a new message``
    (``--followup-len`` tokens). ``send(prompt) -> record`` (:func:`_turn`'s) runs one request."""
    rng = np.random.default_rng([args.seed, doc_len])
    doc = rng.integers(1, vocab, doc_len).tolist()
    prompts = [doc + rng.integers(1, vocab, args.question_len).tolist() for _ in range(clients)]
    messages = [rng.integers(1, vocab, args.followup_len).tolist() for _ in range(clients)]
    turns = [await send(prompts[0])]
    for p in prompts[1:]:
        turns.append(await send(p))
    nexts = [p + t.get("answer", []) + m for p, t, m in zip(prompts, turns, messages)]
    followups = await asyncio.gather(*[send(p) for p in nexts])
    for f, t in zip(followups, turns):
        f["previous_turn_tokens"] = t["prompt_tokens"] + len(t.get("answer", [])) if "answer" in t else None
    return {"doc_len": doc_len, "clients": clients, "first": turns[0], "hits": turns[1:], "followups": list(followups)}


def shared_summary(run: dict, page: int) -> dict:
    """Issue 37's shared-document figures of :func:`shared_document`'s ``run`` (pages of ``page`` tokens).

    * ``hit_ttft_over_first``: each hit's TTFT / the first request's (target <= 0.1 each);
    * ``shared_full_page_tokens``: the document's full pages, in tokens; ``cached_fraction``: each hit's cached
      tokens / that (target >= 0.99 each);
    * per follow-up, ``full_pages_of_previous_turn`` (the full pages of its previous prompt + answer whose every
      position the previous turn computed: all but the answer's last token, which is never fed back), ``pages_hit``
      (its cached tokens / page) and ``missed_pages``; ``followups_hit_every_full_page``: none missed."""
    first, hits, fol = run["first"], [h for h in run["hits"] if "ttft_s" in h], run["followups"]
    shared = run["doc_len"] // page * page
    out = {"doc_len": run["doc_len"], "page_size": page, "shared_full_page_tokens": shared,
           "requests": 1 + len(run["hits"]) + len(fol),
           "errors": [r["error"] for r in [first, *run["hits"], *fol] if "error" in r][:5],
           "first_ttft_s": first.get("ttft_s"), "first_cached_tokens": first.get("cached_tokens")}
    if "ttft_s" in first and hits:
        over = [h["ttft_s"] / first["ttft_s"] for h in hits]
        out["hit_ttft_s"] = {"median": float(np.median([h["ttft_s"] for h in hits])),
                             "max": max(h["ttft_s"] for h in hits)}
        out["hit_ttft_over_first"] = {"each": over, "median": float(np.median(over)), "max": max(over),
                                      "each_le_0.1": max(over) <= 0.1}
    known = [h["cached_tokens"] for h in hits if h.get("cached_tokens") is not None]
    if known and shared:
        frac = [c / shared for c in known]
        out["cached_fraction"] = {"each": frac, "min": min(frac), "mean": float(np.mean(frac)),
                                  "each_ge_0.99": min(frac) >= 0.99 and len(known) == len(hits)}
    rows = []
    for f in fol:
        row = {"ttft_s": f.get("ttft_s"), "prompt_tokens": f.get("prompt_tokens"),
               "cached_tokens": f.get("cached_tokens")}
        if f.get("previous_turn_tokens") is not None and f.get("cached_tokens") is not None:
            # the previous turn ran every position through the model but its last answer token's
            row["full_pages_of_previous_turn"] = (f["previous_turn_tokens"] - 1) // page
            row["pages_hit"] = f["cached_tokens"] // page
            row["missed_pages"] = max(0, row["full_pages_of_previous_turn"] - row["pages_hit"])
        rows.append(row)
    out["followups"] = rows
    counted = [r for r in rows if "missed_pages" in r]
    out["followups_hit_every_full_page"] = bool(counted) and len(counted) == len(rows) and not any(
        r["missed_pages"] for r in counted)
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    out["followup_ttft_s"] = {"median": float(np.median(ttfts)), "max": max(ttfts)} if ttfts else None
    out["sources_of_cached_tokens"] = sorted({r.get("cached_source") or "none" for r in [first, *hits, *fol]})
    return out


def _shared_body(args, clients: int):
    """The body (:func:`serve`) of a shared-document run: every ``--doc-lens`` document in turn."""
    async def go(url, out, vocab):
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(timeout=args.timeout_s,
                                     limits=httpx.Limits(max_connections=clients + 4)) as client:
            t0 = time.perf_counter()

            async def send(prompt):
                rec = _turn(await _stream(client, url, headers, prompt, args.shared_new_tokens, args, t0))
                if "ttft_s" in rec:  # the engine's record: its timeline, and cached tokens if the usage lacks them
                    r = await client.get(f"{url}/bench/cached", params={"key": prompt_key(prompt)})
                    if r.status_code == 200:
                        rec["engine_marks_s"] = r.json()["since_arrival_s"]
                        if rec["cached_tokens"] is None:
                            rec["cached_tokens"], rec["cached_source"] = r.json()["cached_tokens"], "engine"
                return rec

            for doc_len in [int(x) for x in args.doc_lens.split(",")]:
                before = engine_snapshot(url)
                run = await shared_document(send, doc_len, clients, args, vocab)
                run["summary"] = shared_summary(run, out["ready"]["block_size"])
                run["paging"] = paging_counts(before, engine_snapshot(url))
                for r in [run["first"], *run["hits"], *run["followups"]]:
                    r.pop("answer", None)  # (ids: not worth keeping)
                out.setdefault("documents", []).append(run)

    def body(url, out):
        from benchmarks.long_context import shapes

        before = scrape(url)
        asyncio.run(go(url, out, shapes(args.quick)[0].vocab_size))
        after = scrape(url)
        out["metrics"] = {k: after.get(k) for k in ("diffspec_compiles_after_warmup",
                                                    "diffspec_xla_compiles_after_warmup")}
        out["metrics"]["retrievals"] = sum(v - before.get(k, 0.0) for k, v in after.items()
                                           if k.startswith("diffspec_retrievals_total"))
    return body


def run_shared(policy: str, caching: bool, args, limit_s: float | None) -> dict:
    """A server for ``policy`` with prefix caching on or off, under the shared-document workload (off: the first
    ``--baseline-requests`` clients only, each of whose requests prefills the whole document)."""
    clients = args.shared_requests if caching else min(args.shared_requests, args.baseline_requests)
    longest = max(int(x) for x in args.doc_lens.split(","))
    max_len = longest + args.question_len + args.followup_len + 2 * args.shared_new_tokens
    extra = ["--no-offline", "--max-num-seqs", str(clients), "--max-model-len", str(max_len)]
    out = serve(policy, args, extra + ([] if caching else ["--no-prefix-caching"]), limit_s,
                _shared_body(args, clients))
    out.update(workload="shared-doc", prefix_caching=caching, clients=clients)
    return out


def compare_shared(runs: list[dict]) -> list[dict]:
    """Per policy and document, caching on against off for the clients both served: the median TTFT of the first
    request, the hits and the follow-ups, and on / off."""
    rows = []
    for on in (r for r in runs if r.get("workload") == "shared-doc" and r.get("prefix_caching")):
        off = next((r for r in runs if r.get("workload") == "shared-doc" and not r.get("prefix_caching")
                    and r["policy"] == on["policy"]), None)
        for doc in on.get("documents", []):
            other = next((d for d in (off or {}).get("documents", []) if d["doc_len"] == doc["doc_len"]), None)
            summ = doc["summary"]
            row = {"policy": on["policy"], "doc_len": doc["doc_len"],
                   "hit_ttft_over_first_max": (summ.get("hit_ttft_over_first") or {}).get("max"),
                   "cached_fraction_min": (summ.get("cached_fraction") or {}).get("min"),
                   "followups_hit_every_full_page": summ["followups_hit_every_full_page"],
                   "missed_pages": sum(r.get("missed_pages", 0) for r in summ["followups"])}
            if other is not None:
                n = other["clients"]
                for phase, pick in (("first", lambda d: [d["first"]]), ("hits", lambda d: d["hits"]),
                                    ("followups", lambda d: d["followups"])):
                    a = [r["ttft_s"] for r in pick(doc)[:n] if "ttft_s" in r]
                    b = [r["ttft_s"] for r in pick(other)[:n] if "ttft_s" in r]
                    if a and b:
                        row[f"{phase}_ttft_s"] = {"caching_on": float(np.median(a)), "caching_off": float(np.median(b)),
                                                  "on_over_off": float(np.median(a) / np.median(b))}
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ capacity
def capacity_prompts(args, vocab: int) -> list[list[int]]:
    """``--capacity-requests`` random prompts, lengths cycling through ``--capacity-prompt-lens`` (each cut to
    ``--capacity-max-model-len - --capacity-new-tokens``) in a shuffled order."""
    rng = np.random.default_rng(args.seed + 2)
    top = args.capacity_max_model_len - args.capacity_new_tokens
    lens = [min(int(x), top) for x in args.capacity_prompt_lens.split(",")]
    order = rng.permutation(np.resize(lens, args.capacity_requests))
    return [rng.integers(1, vocab, int(n)).tolist() for n in order]


def run_capacity(kind: str, args, limit_s: float | None, pool: dict | None) -> dict:
    """The capacity workload on one server: ``paged`` (``--capacity-seqs`` sequences over the pool) or ``fixed``
    (the same pool, ``pool tokens // --capacity-max-model-len`` sequences: what fixed slots of that length hold).
    ``pool``: the paged run's ``ready`` (its ``num_kv_blocks``), which the fixed run reuses."""
    extra = ["--no-offline", "--max-model-len", str(args.capacity_max_model_len)]
    if kind == "paged":
        seqs = args.capacity_seqs
    else:
        if not pool:
            return {"workload": "capacity", "kind": kind, "policy": args.capacity_policy, "wall_s": 0.0,
                    "error": "the paged run did not report its pool"}
        seqs = max(1, pool["pool_tokens"] // args.capacity_max_model_len)
        extra += ["--num-kv-blocks", str(pool["num_kv_blocks"])]
    # every request sent at once (a client each), the capacity workload's token count
    load = argparse.Namespace(**{**vars(args), "clients": args.capacity_requests, "requests": args.capacity_requests,
                                 "rate": 0.0, "new_tokens": args.capacity_new_tokens, "num_kv_blocks": None})
    if kind == "paged":
        load.num_kv_blocks = args.num_kv_blocks or (QUICK_CAPACITY_BLOCKS if args.quick else None)

    def body(url, out):
        from benchmarks.long_context import shapes

        out["server"] = run_load(url, capacity_prompts(args, shapes(args.quick)[0].vocab_size), load, ids_text=True)

    out = serve(args.capacity_policy, load, extra + ["--max-num-seqs", str(seqs)], limit_s, body)
    out.update(workload="capacity", kind=kind, max_num_seqs=seqs)
    return out


def compare_capacity(runs: list[dict]) -> dict | None:
    """Paged against fixed slots: requests decoding at once (peak, mean), tokens/s, ITL p50 / p99 and p99 / p50,
    compiles after warm-up, preemptions, and the paged / fixed ratios (issue 37: peak >= 2x, tokens/s to match,
    ITL p99 / p50 <= 1.3, no compile after warm-up)."""
    by = {r["kind"]: r for r in runs if r.get("workload") == "capacity" and r.get("server")}
    if not by:
        return None
    out = {}
    for kind, r in by.items():
        s = r["server"]
        out[kind] = {"max_num_seqs": r["max_num_seqs"], "pool_tokens": r["ready"]["pool_tokens"],
                     "decoding_peak": s["decoding_at_once"]["peak"], "decoding_mean": s["decoding_at_once"]["mean"],
                     "output_tokens_per_s": s["output_tokens_per_s"], "itl_s": s["itl_s"],
                     "ttft_s": s["ttft_s"], "completed": s["completed"], "requests": s["requests"],
                     "compiles_after_warmup": s["metrics"].get("diffspec_compiles_after_warmup"),
                     "preemptions": (s.get("paging") or {}).get("preemptions")}
    if "paged" in out and "fixed" in out:
        p, f = out["paged"], out["fixed"]
        out["paged_over_fixed"] = {key: ratio(p[key], f[key]) for key in
                                   ("decoding_peak", "decoding_mean", "output_tokens_per_s")}
    if "paged" in out:
        itl = (out["paged"]["itl_s"] or {}).get("p99_over_p50")
        out["paged_itl_p99_over_p50_le_1.3"] = itl is not None and itl <= 1.3
    return out


# ------------------------------------------------------------------------------------------ memory pressure
def run_pressure(args, limit_s: float | None) -> dict:
    """A load made to exhaust the page pool: ``--pressure-requests`` prompts (``--pressure-prompt-lens``) sent at
    once to ``--pressure-seqs`` sequences over a pool of ``--pressure-pool-tokens``, greedy. The child first runs
    ``generate()`` on each prompt alone (:func:`reference_alone`); every server answer must equal it, the server
    must preempt, and once idle no page may be in use."""
    load = argparse.Namespace(**{**vars(args), "clients": args.pressure_requests, "requests": args.pressure_requests,
                                 "prompt_lens": args.pressure_prompt_lens, "rate": 0.0,
                                 "new_tokens": args.pressure_new_tokens,
                                 "num_kv_blocks": -(-args.pressure_pool_tokens // args.block_size)})
    longest = max(int(x) for x in args.pressure_prompt_lens.split(","))
    extra = ["--no-offline", "--reference-alone", "--max-num-seqs", str(args.pressure_seqs), "--max-model-len",
             str(longest + args.pressure_new_tokens)]

    def body(url, out):
        from benchmarks.long_context import shapes

        import httpx

        prompts = make_requests(load, shapes(args.quick)[0].vocab_size)
        out["server"] = run_load(url, prompts, load, ids_text=True, keep_answers=True)
        out["server"]["preempted"] = [httpx.get(f"{url}/bench/cached", params={"key": prompt_key(p)}, timeout=30)
                                      .json().get("preemptions") for p in prompts]

    out = serve(args.pressure_policy, load, extra, limit_s, body)
    out.update(workload="pressure", max_num_seqs=args.pressure_seqs, pool_tokens=args.pressure_pool_tokens)
    out["check"] = pressure_check(out)
    if out.get("server"):
        out["server"].pop("answers", None)  # (ids: the check keeps what matters)
    return out


def pressure_check(run: dict) -> dict | None:
    """Every answer against ``generate()`` alone: ``completed``, ``equal`` (requests), the first differing token
    of each that differs, preemptions, pages in use once idle, a digest of each answer (two runs compared without
    their tokens); ``ok``: all completed and equal, preempted at least once, no page in use."""
    srv, ref = run.get("server"), (run.get("reference") or {}).get("tokens")
    if not srv or ref is None or "answers" not in srv:
        return None
    answers = srv["answers"]
    differ = {}
    for i, (a, r) in enumerate(zip(answers, ref)):
        if a is not None and a != r:
            differ[i] = next((j for j, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r)))
    paging = srv.get("paging") or {}
    preempted = srv.get("preempted") or [None] * len(answers)
    out = {"requests": len(answers), "completed": sum(a is not None for a in answers),
           "equal": sum(a is not None and a == r for a, r in zip(answers, ref)), "first_difference": differ,
           "preempted_requests": sum(bool(n) for n in preempted),
           "differing_preempted": [bool(preempted[i]) for i in differ],
           "preemptions": paging.get("preemptions"), "replayed_tokens": paging.get("replayed_tokens"),
           "kv_blocks_used_idle": paging.get("kv_blocks_used_after"),
           "answer_digests": [None if a is None else hashlib.sha256(np.asarray(a, np.int32).tobytes()).hexdigest()[:12]
                              for a in answers]}
    out["ok"] = (out["completed"] == out["equal"] == len(answers) and bool(out["preemptions"])
                 and out["kv_blocks_used_idle"] == 0)
    return out


# ------------------------------------------------------------------------------------------ report
def _plot_load(runs, payload, a, b) -> None:
    names = [r["policy"] for r in runs]
    x = np.arange(len(runs))
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


def _plot_shared(runs, a, b) -> None:
    for i, r in enumerate(runs):
        for j, doc in enumerate(r.get("documents", [])):
            reqs = [doc["first"], *doc["hits"], *doc["followups"]]
            label = f"{r['policy']}, {doc['doc_len']}-token doc, caching {'on' if r['prefix_caching'] else 'off'}"
            style = dict(marker="o" if r["prefix_caching"] else "x", ls="-" if r["prefix_caching"] else ":",
                         color=f"C{2 * j + (0 if r['prefix_caching'] else 1)}", ms=3)
            a.plot([q.get("ttft_s", np.nan) for q in reqs], label=label, **style)
            b.plot([(q.get("cached_tokens") or 0) / q["prompt_tokens"] if q.get("prompt_tokens") else np.nan
                    for q in reqs], label=label, **style)
    n = max((len(d["hits"]) + 1 for r in runs for d in r.get("documents", [])), default=0)
    for ax in (a, b):
        ax.axvline(n - 0.5, color="grey", lw=0.8)
        ax.set_xlabel(f"request (0: first; 1-{n - 1}: hits, one at a time; {n}-: follow-ups, all at once)")
        ax.legend(fontsize=7)
    a.set_yscale("log")
    a.set(title="shared document: TTFT per request", ylabel="s")
    b.set(title="cached tokens / prompt tokens", ylabel="share")


def _plot_capacity(runs, a, b) -> None:
    for i, r in enumerate(runs):
        s = r["server"]
        series = s["decoding_at_once"]["series"]
        if series:
            a.step([p[0] for p in series], [p[1] for p in series], where="post", color=f"C{i}",
                   label=f"{r['kind']} ({r['max_num_seqs']} seqs): peak {s['decoding_at_once']['peak']}, "
                         f"{s['output_tokens_per_s'] or 0:.0f} tok/s")
    a.set(title="capacity: requests decoding at once", xlabel="s since the load started", ylabel="requests")
    a.legend(fontsize=7)
    x = np.arange(len(runs))
    for i, q in enumerate(("p50", "p99")):
        b.bar(x + (i - 0.5) * 0.4, [((r["server"]["itl_s"] or {}).get(q) or 0) * 1e3 for r in runs], 0.4,
              label=f"ITL {q}")
    b.set_xticks(x, [r["kind"] for r in runs])
    b.set(title="capacity: per-token ITL", ylabel="ms")
    b.legend(fontsize=8)


def _plot_pressure(runs, a, b) -> None:
    r = runs[0]
    s, check = r["server"], r.get("check") or {}
    series = s["decoding_at_once"]["series"]
    if series:
        a.step([p[0] for p in series], [p[1] for p in series], where="post")
    a.set(title=f"pressure: decoding at once ({r['pool_tokens']}-token pool, {check.get('preemptions')} preemptions)",
          xlabel="s since the load started", ylabel="requests")
    names = ("requests", "completed", "equal")
    b.bar(names, [check.get(n) or 0 for n in names])
    b.set(title=f"pressure: answers equal to generate() alone (pages in use once idle: "
                f"{check.get('kv_blocks_used_idle')})", ylabel="requests")


def plot(payload: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = [(name, [r for r in payload["runs"] if r.get("workload", "load") == name and
                      (r.get("server") or r.get("documents"))]) for name in WORKLOADS]
    groups = [(name, runs) for name, runs in groups if runs]
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.2 * len(groups)), squeeze=False)
    draw = {"load": lambda runs, a, b: _plot_load(runs, payload, a, b), "shared-doc": _plot_shared,
            "capacity": _plot_capacity, "pressure": _plot_pressure}
    for (name, runs), (a, b) in zip(groups, axes):
        draw[name](runs, a, b)
    s = payload["settings"]
    what = {"load": f"load: {s['clients']} clients, {s['requests']} requests, prompts {s['prompt_lens']}, "
                    f"{s['new_tokens']} new tokens, rate {s['rate'] or 'all at once'}",
            "shared-doc": f"shared-doc: documents {s['doc_lens']}, {s['shared_requests']} clients, "
                          f"{s['shared_new_tokens']} new tokens",
            "capacity": f"capacity: {s['capacity_requests']} requests at once, prompts {s['capacity_prompt_lens']}, "
                        f"{s['capacity_new_tokens']} new tokens",
            "pressure": f"pressure: {s['pressure_requests']} requests at once, prompts {s['pressure_prompt_lens']}, "
                        f"{s['pressure_new_tokens']} new tokens"}
    fig.suptitle("; ".join(what[name] for name, _ in groups) + (" (random weights)" if not s.get("url") else ""),
                 fontsize=9)
    from benchmarks.common import save_figure

    return save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (only the load runs)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="the model name to send (--url)")
    ap.add_argument("--workloads", default="load", help=f"comma-separated, of {WORKLOADS}")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {POLICIES} (workload load)")
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
    ap.add_argument("--deterministic", action="store_true",
                    help="SpecConfig(deterministic=True) in the server and in generate() alone (issue 40's mode)")
    ap.add_argument("--max-prefill-per-block", type=int, default=None,
                    help="the server's prompt tokens between two decode blocks while slots decode (default one chunk)")
    pool = ap.add_argument_group("the server's page pool (every workload)")
    pool.add_argument("--block-size", type=int, default=128,
                      help="tokens per K/V page (default 128, the server's default on a GPU)")
    pool.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                      help="the pool's K/V storage (fp8: 8-bit rows, issue 41; run the capacity workload once with "
                           "each to compare how many requests decode at once)")
    pool.add_argument("--num-kv-blocks", type=int, default=None,
                      help="pages in the pool (default: sized by the device's memory; capacity: the paged run's "
                           "pool, which the fixed-slots run reuses)")
    pool.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                      help="share of the device's memory the server may fill (default: the engine's, 0.9)")
    shared = ap.add_argument_group("workload shared-doc")
    shared.add_argument("--doc-lens", default="32768,65536", help="the shared documents' lengths (tokens)")
    shared.add_argument("--shared-requests", type=int, default=16, help="clients, one question each")
    shared.add_argument("--shared-policies", default="diffspec",
                        help=f"of {POLICIES}, each served with prefix caching on and off")
    shared.add_argument("--question-len", type=int, default=64, help="tokens of each client's question")
    shared.add_argument("--followup-len", type=int, default=64, help="tokens of each client's follow-up message")
    shared.add_argument("--shared-new-tokens", type=int, default=64, help="tokens per answer")
    shared.add_argument("--baseline-requests", type=int, default=4,
                        help="clients of the prefix-caching-off server (each of its requests prefills the whole "
                             "document; 0: no such server)")
    cap = ap.add_argument_group("workload capacity")
    cap.add_argument("--capacity-requests", type=int, default=48, help="requests, all sent at once")
    cap.add_argument("--capacity-prompt-lens", default="2048,4096,8192,16384,32768,65536",
                     help="prompt lengths, cycled (each cut to --capacity-max-model-len - --capacity-new-tokens)")
    cap.add_argument("--capacity-new-tokens", type=int, default=256)
    cap.add_argument("--capacity-max-model-len", type=int, default=65536,
                     help="max_model_len of both servers; the fixed-slots run gets pool tokens // this many slots")
    cap.add_argument("--capacity-seqs", type=int, default=64, help="sequences the paged server decodes together")
    cap.add_argument("--capacity-policy", default="diffspec", help=f"of {POLICIES}")
    cap.add_argument("--capacity-kinds", default="paged,fixed",
                     help="servers to run, of paged,fixed (fixed slots reuse the paged run's pool; 'paged' alone "
                          "for comparing --kv-cache-dtype runs)")
    pres = ap.add_argument_group("workload pressure")
    pres.add_argument("--pressure-requests", type=int, default=12, help="requests, all sent at once")
    pres.add_argument("--pressure-prompt-lens", default="4096,8192,16384",
                      help="prompt lengths (tokens), cycled in a shuffled order")
    pres.add_argument("--pressure-new-tokens", type=int, default=256)
    pres.add_argument("--pressure-seqs", type=int, default=12, help="sequences the server decodes together")
    pres.add_argument("--pressure-pool-tokens", type=int, default=49152,
                      help="the page pool (tokens): far less than the load needs")
    pres.add_argument("--pressure-policy", default="diffspec", help=f"of {POLICIES}")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per request (server and client)")
    ap.add_argument("--policy-timeout-s", type=float, default=0.0,
                    help="kill a run's child server after this many seconds (0: no limit)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="start no further run once the run is past this many seconds, or would be by the mean "
                         "time of the runs so far; each run's time limit is at most what remains (0: none)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a small load (CPU smoke test)")
    ap.add_argument("--out", default=None, help="output directory: serve_load.json and serve_load.png (required)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a serve_load.json / serve_load.png in --out that no diffspec tool wrote (moved to "
                         "NAME.replaced-<time>, nothing is deleted)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-prefix-caching", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-offline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reference-alone", action="store_true", help=argparse.SUPPRESS)
    return ap


#: --quick's defaults for what the command line leaves at its defaults (tiny shapes on a CPU)
QUICK = (("clients", 4), ("requests", 8), ("prompt_lens", "64,256,512"), ("new_tokens", 64), ("budget", 64),
         ("chunk", 16), ("prefill_chunk", 32), ("block_size", 16), ("doc_lens", "128,256"), ("shared_requests", 4),
         ("question_len", 8), ("followup_len", 8), ("shared_new_tokens", 8), ("baseline_requests", 2),
         ("capacity_requests", 8), ("capacity_prompt_lens", "32,64,128,256,448"), ("capacity_new_tokens", 16),
         ("capacity_max_model_len", 512), ("capacity_seqs", 8), ("pressure_requests", 6),
         ("pressure_prompt_lens", "64,128,256"), ("pressure_new_tokens", 48), ("pressure_seqs", 6),
         ("pressure_pool_tokens", 480))
#: --quick's pool for the capacity workload (a CPU reports no memory to size it by): 2.5 requests of 512 tokens, so
#: the fixed-slots run gets 2 sequences
QUICK_CAPACITY_BLOCKS = 80


def _jobs(args, ap) -> list[tuple[str, object]]:
    """The runs of ``--workloads``, in order: ``(name, run(limit_s, runs_so_far) -> dict)``."""
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads takes names of {WORKLOADS}, got {w!r}")
    names = {"load": args.policies, "shared-doc": args.shared_policies, "capacity": args.capacity_policy,
             "pressure": args.pressure_policy}
    for w in workloads:
        for policy in names[w].split(","):
            if policy not in POLICIES:
                ap.error(f"the policies of workload {w} are names of {POLICIES}, got {policy!r}")
    jobs = []
    for w in workloads:
        if w == "load":
            jobs += [(f"load {p}", lambda limit, runs, p=p: run_policy(p, args, limit))
                     for p in args.policies.split(",")]
        elif w == "shared-doc":
            caching = (True, False) if args.baseline_requests else (True,)
            jobs += [(f"shared-doc {p} caching {'on' if c else 'off'}",
                      lambda limit, runs, p=p, c=c: run_shared(p, c, args, limit))
                     for p in args.shared_policies.split(",") for c in caching]
        elif w == "pressure":
            jobs.append(("pressure", lambda limit, runs: run_pressure(args, limit)))
        else:
            def fixed(limit, runs):
                paged = next((r for r in runs if r.get("workload") == "capacity" and r.get("kind") == "paged"), {})
                return run_capacity("fixed", args, limit, paged.get("ready"))

            kinds = [k.strip() for k in args.capacity_kinds.split(",") if k.strip()]
            if not kinds or set(kinds) - {"paged", "fixed"} or kinds[0] != "paged":
                ap.error(f"--capacity-kinds takes paged[,fixed], got {args.capacity_kinds!r}")
            jobs.append(("capacity paged", lambda limit, runs: run_capacity("paged", args, limit, None)))
            jobs += [("capacity fixed slots", fixed)] if "fixed" in kinds else []
    return jobs


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.quick:  # small defaults for what the command line leaves at its defaults
        defaults = parser().parse_args([])
        for key, value in QUICK:
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    if args.child:
        return child(args)
    if not args.out:
        parser().error("--out DIR is required")
    if args.url and args.workloads != "load":
        parser().error("--url runs the load workload only (shared-doc and capacity start their own servers)")
    jobs = [] if args.url else _jobs(args, parser())
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
        t0 = time.perf_counter()
        for name, job in jobs:
            limit = args.policy_timeout_s or None
            if args.time_budget_s:
                spent = time.perf_counter() - t0
                mean = spent / len(payload["runs"]) if payload["runs"] else 0.0
                if spent + mean > args.time_budget_s:
                    payload.setdefault("skipped", []).append(name)
                    print(f"skipping {name}: {spent:.0f} s spent of --time-budget-s {args.time_budget_s:g}"
                          f" (mean {mean:.0f} s per run)", flush=True)
                    continue
                limit = min(limit or np.inf, args.time_budget_s - spent)
            payload["runs"].append(job(limit, payload["runs"]))
            payload["shared_doc"] = compare_shared(payload["runs"]) or None
            payload["capacity"] = compare_capacity(payload["runs"])
            payload["pressure"] = next((r.get("check") for r in payload["runs"] if r.get("workload") == "pressure"),
                                       None)
            write_json(result, payload)
    write_json(result, payload)
    png = plot(payload, figure)
    for r in payload["runs"]:
        s = r.get("server") or {}
        print(json.dumps({"workload": r.get("workload", "load"), "policy": r["policy"],
                          **{k: r[k] for k in ("kind", "prefix_caching") if k in r},
                          "server_tok_s": s.get("output_tokens_per_s"),
                          "offline_tok_s": (r.get("offline") or {}).get("output_tokens_per_s"),
                          "ratio": r.get("throughput_vs_offline"), "ttft": s.get("ttft_s"), "itl": s.get("itl_s"),
                          "decoding_at_once": {k: v for k, v in (s.get("decoding_at_once") or {}).items()
                                               if k != "series"},
                          "metrics": s.get("metrics") or r.get("metrics"),
                          **({"error": r["error"]} if r.get("error") else {})}))
    for key in ("shared_doc", "capacity"):
        if payload.get(key):
            print(key, json.dumps(payload[key], indent=1))
    print(f"wrote {out / 'serve_load.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
