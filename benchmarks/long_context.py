"""Long-context cycle anatomy on production shapes, the HBM floor, and the transformers peer.

    python benchmarks/long_context.py --contexts 8192,32768,65536,131072 --batches 1,8 \\
        --out benchmarks/results/long_context_h200.json [--peer --peer-compiled]

A Llama-3.1-8B-shaped target and an EAGLE-3-shaped draft with **random bfloat16 weights** (the shapes of the
public checkpoints): timings are valid, acceptance is meaningless, so speedups are *projected* from the measured
cycle times at given acceptance lengths (a grid, and the demo pair's, measured by ``paired.py``). Caches are filled
with random values instead of a prefill (the cost of a step does not depend on their contents).

Per (context, batch):

* the target's decode step (1 token) and verify step (K + 1 tokens), the draft's K proposals over its full store
  (plain EAGLE-3) and over the working cache (DiffSpec), and one whole cycle of each policy: jitted calls
  dispatched back to back with the state donated (``pipelined``: what a decode loop sustains while the host keeps
  ahead of the device), plus the decode step and cycles with a host sync after every call (``blocking``);
* chunk scoring, selection and gather-RoPE-write: device time inside a jitted loop (no host dispatch), and the
  engine's retrieval call (scoring + selection) dispatched back to back;
* the bytes a target decode step must move (every weight except the embedding table, of which B rows are read, plus
  the KV up to the context) over the copy bandwidth measured in the same run: the HBM floor.

``--draft self`` measures self-drafting instead of the EAGLE-3 draft (docs/self_drafting.md): per (context, batch) the
target's decode and verify steps, and per ``--self-budgets`` working-set size one self-draft step (the target's step
over its working set), the K proposals with the working set's update, its rebuild after a new selection, the
retrieval call and a whole self-drafting cycle; the self-draft step over the target's decode step, and projected
speedups at given acceptance lengths and at the self-drafting acceptance ``paired.py --draft self`` measured on the
demo target (``--self-acceptance``; indicative only: another model).

``--peer`` adds Hugging Face ``transformers`` (torch, sdpa) decoding the same weights at the same context (batch 1)
in a child process (so the two frameworks never share the GPU's memory pools): eager with the default dynamic cache,
and ``--peer-compiled`` ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` (CUDA graphs). The child rebuilds
the weights from the same seed with the same JAX code and checks their hashes against the parent's.

The JSON (and the PNG next to it, when matplotlib is installed) is rewritten after every case, so a run stopped
early keeps what it measured; ``--resume FILE`` continues from such a file (cases and peer contexts in it are kept
and skipped). ``--quick`` runs tiny shapes anywhere (smoke test). ``--plot-only FILE`` redraws the figure.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (REPO, add_output_arguments, add_plot_only_argument, claim_outputs, context_axis,
                               copy_bandwidth, environment, log_yticks, matmul_peak, redraw, reference_line,
                               save_figure, write_json)
from benchmarks.self_projection import acceptance_of, cycle_with_retrieval, project

#: acceptance lengths (tokens per verification, bonus included) for projected speedups; random weights accept
#: nothing, so the measured cycle times are combined with these
PROJECTION_ACCEPTANCE = (1.5, 2.0, 3.0, 4.0)
#: the demo pair's measured acceptance (paired.py, H200) used for a second projection, read from this file
DEMO_PAIRED = REPO / "benchmarks" / "results" / "paired_demo_h200.json"
#: issue 8's targets
TARGET_FLOOR_RATIO, TARGET_VS_COMPILED, TARGET_VS_EAGER = 1.3, 3.0, 8.0
TARGET_DRAFT_FLAT, TARGET_RETRIEVAL_SHARE = 1.1, 0.05
#: issue 22's targets
TARGET_PREFILL_64K_S, TARGET_PREFILL_PEAK_FRACTION, TARGET_VERIFY_OVER_DECODE = 3.3, 0.65, 1.15
#: issue 28's target: the self-draft step at a 2K budget costs at most this share of the target step at 64K x 8
TARGET_SELF_STEP_SHARE = 0.5
#: the self-drafting acceptance (``paired.py --draft self`` on the demo target) the projections use by default
SELF_PAIRED = REPO / "benchmarks" / "results" / "paired_self_demo_cpu.json"
PEER_PREFIX = "PEER_JSON "
RANDOM_NOTE = ("random weights: every timing is valid, acceptance is meaningless; speedups are projected from the "
               "measured cycle times at given acceptance lengths")


# --------------------------------------------------------------------------------------------- models
def shapes(quick: bool):
    from diffspec_jax.config import DraftConfig, ModelConfig, RopeConfig

    if quick:
        t = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=1 << 17, rope=RopeConfig(theta=500000.0))
        d = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, draft_vocab_size=256, target_hidden_size=64,
                        aux_layer_ids=(0, 1, 1))
        return t, d
    t = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=131072 + 8192,
                    rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192))
    d = DraftConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                    aux_layer_ids=(2, 16, 29))
    return t, d


@functools.partial(jax.jit, static_argnums=(1,))
def _normal_bf16(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)


def _random_tree(shapes_tree, key):
    from diffspec_jax.models import llama

    leaves, tree = jax.tree_util.tree_flatten(shapes_tree, is_leaf=llama.is_shape)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(tree, [_normal_bf16(k, tuple(s)) for k, s in zip(keys, leaves)])


def random_target(tcfg, seed=0, *, fuse_projections=True):
    """Random bf16 target params made on the device (no host copy of 16 GB); one compile per distinct shape.
    ``fuse_projections``: in the serving layout :func:`diffspec_jax.load_target` gives (else the checkpoint
    layout, which the transformers export reads)."""
    from diffspec_jax.models import llama
    from diffspec_jax.target import TargetModel

    params = _random_tree(llama.param_shapes(tcfg), jax.random.PRNGKey(seed))
    return TargetModel(tcfg, llama.fuse_layers_in_place(params) if fuse_projections else params)


def random_draft(dcfg, target, seed=0):
    from diffspec_jax.models import eagle3

    dshapes = eagle3.param_shapes(dcfg, num_aux=3)
    d2t = dshapes.pop("d2t")
    dparams = _random_tree(dshapes, jax.random.PRNGKey(seed + 1))
    used = np.sort(np.random.default_rng(seed).choice(dcfg.vocab_size, d2t[0], replace=False))
    dparams["d2t"] = jnp.asarray(used - np.arange(len(used)), jnp.int32)
    dparams["embed"] = target.params["embed"]
    return dparams


def weight_hashes(params) -> dict[str, str]:
    """sha256 of a few target leaves (bytes as stored): the peer child checks it rebuilt the same weights."""
    picks = {"layers.0.wo": params["layers"][0]["wo"], "layers.-1.w_down": params["layers"][-1]["w_down"],
             "final_norm": params["final_norm"]}
    return {k: hashlib.sha256(np.asarray(jax.device_get(v)).tobytes()).hexdigest() for k, v in picks.items()}


# --------------------------------------------------------------------------------------------- timing
def _stats(ts, **extra) -> dict:
    med = statistics.median(ts)
    cv = statistics.pstdev(ts) / statistics.mean(ts) if len(ts) > 1 else 0.0
    return {"median_s": med, "cv": cv, "repeats": len(ts), **extra}


def pipelined(call, *, repeats: int, inner: int) -> dict:
    """Seconds per ``call()`` with ``inner`` calls dispatched back to back and one wait; median over repeats.
    The first two calls (compile, warm-up) are not counted."""
    for _ in range(2):
        jax.block_until_ready(call())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner)
    return _stats(ts, inner=inner, mode="pipelined")


def blocking(call, *, repeats: int) -> dict:
    """Seconds per ``call()`` waited for one by one (host dispatch and the sync included)."""
    jax.block_until_ready(call())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return _stats(ts, mode="blocking")


def device_loop(step, carry, consts, *, iters: int, repeats: int, donate: bool):
    """Device seconds per ``carry = step(carry, consts)``: ``iters`` calls inside one jitted ``fori_loop`` (no
    host dispatch); ``consts`` are arguments of the loop, not closure constants. Returns ``(stats, carry)``."""
    loop = jax.jit(lambda c, k: jax.lax.fori_loop(0, iters, lambda i, x: step(x, k), c),
                   donate_argnums=(0,) if donate else ())
    carry = loop(carry, consts)
    jax.block_until_ready(carry)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = loop(carry, consts)
        jax.block_until_ready(carry)
        ts.append((time.perf_counter() - t0) / iters)
    return _stats(ts, iters=iters, mode="device loop"), carry


# -------------------------------------------------------------------------------------------- anatomy
def _plans(tc, dcfg, ctx, args):
    from diffspec_jax import engine
    from diffspec_jax.config import SamplingConfig, SpecConfig
    from diffspec_jax.engine.propose import Eagle3Drafter

    cap = ctx + 64 * (args.k + 1) + 64
    plans = {}
    for policy in ("full", "diffspec"):
        spec = SpecConfig.from_flat(dict(num_speculative_tokens=args.k, draft_context_policy=policy,
                                         diffspec_chunk_size=args.chunk, diffspec_token_budget=args.budget,
                                         diffspec_retrieval_interval=args.interval))
        plans[policy] = engine.Plan(target=tc, draft=dcfg, spec=spec, sampling=SamplingConfig(),
                                    aux_layers=dcfg.aux_layer_ids, capacity=cap, drafter=Eagle3Drafter())
    return plans


def fill_random(tree, seed: int = 7):
    """``tree`` with every bf16 (or fp8: an 8-bit cache's rows) leaf of rank >= 3 (caches, pools, stores) replaced
    by random values, in place (an 8-bit cache's float32 scales stay 0: a step's cost does not depend on them)."""
    # keep_unused: x's value is not read, so jit would prune it and its donation with it; the zero buffers, held by
    # the tree until tree_map returns, would then all stay alive beside the random ones (2 x 66.5 GiB at 64K x 8)
    fill = jax.jit(lambda x, key: jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype), donate_argnums=(0,),
                   keep_unused=True)
    key = jax.random.PRNGKey(seed)
    kinds = (jnp.bfloat16, jnp.float8_e4m3fn)
    return jax.tree_util.tree_map(lambda x: fill(x, key) if x.ndim >= 3 and x.dtype in kinds else x, tree)


@functools.lru_cache(maxsize=None)
def jitted_step(tc):
    """The target's cached step (:func:`diffspec_jax.models.llama.step`) of config ``tc``, jitted once per config
    (the cache, argument 1, donated): every caller of the same shapes shares its compilations."""
    from diffspec_jax.models import llama

    return jax.jit(functools.partial(llama.step, tc), donate_argnums=(1,))


def step_calls(target, holder: dict, start, batch: int, token_counts) -> dict:
    """``{T: call}``: each ``call()`` runs the target's step of ``T`` tokens per sequence at committed lengths
    ``start [B]`` against ``holder["cache"]`` (donated; the updated cache is put back in ``holder``) and returns the
    logits. The cache's length never moves, so every call runs at the same context."""
    step = jitted_step(target.config)
    calls = {}
    for n_tok in token_counts:
        toks = jnp.ones((batch, n_tok), jnp.int32)
        rows = jnp.broadcast_to(jnp.arange(n_tok, dtype=jnp.int32), (batch, n_tok))

        def call(toks=toks, rows=rows):
            o, holder["cache"] = step(target.params, holder["cache"], toks, start, rows)
            return o.logits

        calls[n_tok] = call
    return calls


def _filled_state(plan, batch, ctx):
    """A decode state at committed length ``ctx`` whose caches hold random values (bf16 leaves of rank >= 3)."""
    from diffspec_jax import engine

    st = fill_random(engine.init_state(plan, batch, jnp.bfloat16, jnp.bfloat16, 0))
    return st.replace(length=jnp.full((batch,), ctx, jnp.int32), pend_count=jnp.ones((batch,), jnp.int32),
                      last_token=jnp.ones((batch,), jnp.int32))


def _time_propose(plan, dparams, st, active, key, t):
    """The draft's K proposals (step 0 with commit + rebuild, then the chain), caches donated as in the engine."""
    from diffspec_jax import engine

    def prop(dparams, slim, dcache, ret, active, key):
        drafts, _, cache, ret2, _, _ = engine.draft_propose(plan, dparams, slim.replace(draft_cache=dcache,
                                                                                     retrieval=ret), active, key)
        return drafts, cache, ret2

    propose = jax.jit(prop, donate_argnums=(2, 3))
    # the target's K/V stay out of the call (the draft reads only the cache's page table, if paged)
    slim = st.replace(target_cache=st.target_cache.replace(k=(), v=()), draft_cache=None, retrieval=None)
    holder = {"dc": st.draft_cache, "ret": st.retrieval}

    def call():
        drafts, holder["dc"], holder["ret"] = propose(dparams, slim, holder["dc"], holder["ret"], active, key)
        return drafts

    res = pipelined(call, repeats=t.repeats, inner=t.inner)
    return res, st.replace(draft_cache=holder["dc"], retrieval=holder["ret"])


def _time_cycle(fns, tparams, dparams, st, active, ctx, t):
    """Whole cycles (draft -> verify -> accept, state donated); the committed length is put back to ``ctx`` after
    every cycle so each one runs at the same context."""
    holder = {"s": st}
    length = np.full(st.length.shape, ctx, np.int32)

    def call():
        s, emitted, *_ = fns.cycle(tparams, dparams, holder["s"], active)
        holder["s"] = s.replace(length=jnp.asarray(length))
        return emitted

    res = {"pipelined": pipelined(call, repeats=t.repeats, inner=t.inner),
           "blocking": blocking(call, repeats=t.repeats)}
    return res, holder["s"]


def anatomy(target, dcfg, dparams, ctx, batch, args):
    """Component and cycle times of one (context, batch)."""
    from diffspec_jax import engine, retrieval, working_cache
    from pallas_kernels import dispatch

    k, tc, t = args.k, target.config, args
    plans = _plans(tc, dcfg, ctx, args)
    key = jax.random.PRNGKey(1)
    active = jnp.ones((batch,), bool)
    stats: dict[str, dict] = {}
    out = {"context": ctx, "batch": batch, "capacity": plans["full"].capacity, "stats": stats}

    # ---- target steps, then the full-store policy (one state at a time: at 64K x 8 a KV cache is 64 GiB)
    st = _filled_state(plans["full"], batch, ctx)
    holder = {"cache": st.target_cache}
    st = st.replace(target_cache=None)
    calls = step_calls(target, holder, st.length, batch, (1, k + 1))
    stats["target_decode_step"] = pipelined(calls[1], repeats=t.repeats, inner=t.inner)
    stats["target_decode_step_blocking"] = blocking(calls[1], repeats=t.repeats)
    stats["target_verify_step"] = pipelined(calls[k + 1], repeats=t.repeats, inner=t.inner)
    # the decode step once more, after the verify step (a check that warm-up and order do not move it)
    stats["target_decode_step_again"] = pipelined(calls[1], repeats=t.repeats, inner=t.inner)
    st = st.replace(target_cache=holder["cache"])
    del holder, calls
    if args.steps_only:
        del st
        gc.collect()
        return _derived(out, stats, tc, ctx, batch, args)
    stats["draft_propose_full"], st = _time_propose(plans["full"], dparams, st, active, key, t)
    cyc, st = _time_cycle(engine.compiled(plans["full"]), target.params, dparams, st, active, ctx, t)
    stats["cycle_full"], stats["cycle_full_blocking"] = cyc["pipelined"], cyc["blocking"]
    del st
    gc.collect()

    # ---- DiffSpec: retrieval call, its components, the working-cache draft and the cycle
    plan = plans["diffspec"]
    fns = engine.compiled(plan)
    holder = {"s": _filled_state(plan, batch, ctx)}
    length = np.full((batch,), ctx, np.int32)
    for _ in range(2):  # a verification fills the scoring query and LSE
        s, *_ = fns.cycle(target.params, dparams, holder["s"], active)
        holder["s"] = s.replace(length=jnp.asarray(length))
        del s

    def ret_call(holder=holder):
        holder["s"], anchors = fns.retrieve(target.params, dparams, holder["s"], active)
        return anchors

    stats["retrieve"] = pipelined(ret_call, repeats=t.repeats, inner=t.inner)
    st = holder["s"]
    del holder, ret_call
    stats["draft_propose_diffspec"], st = _time_propose(plan, dparams, st, active, key, t)
    cyc, st = _time_cycle(fns, target.params, dparams, st, active, ctx, t)  # with anchors selected
    stats["cycle_diffspec"], stats["cycle_diffspec_blocking"] = cyc["pipelined"], cyc["blocking"]

    ret = st.retrieval
    root = st.length - 1
    kc = st.target_cache.layer_keys(plan.score_layer)
    chunk, nsel = args.chunk, plan.spec.max_chunks

    def score_step(q, c):
        lse, kc, root = c
        s = dispatch.chunk_scores(q, lse, kc, root, chunk=chunk)
        return q + 1e-30 * jnp.sum(s)

    stats["chunk_scores"], _ = device_loop(score_step, ret.score_q, (ret.score_lse, kc, root), iters=t.iters,
                                           repeats=t.repeats, donate=False)
    scores = dispatch.chunk_scores(ret.score_q, ret.score_lse, kc, root, chunk=chunk) / tc.num_attention_heads

    def select_step(s, root):
        a = retrieval.select_chunks(s, root, chunk, nsel, False)
        return s + 1e-30 * jnp.sum(a).astype(s.dtype)

    stats["selection"], _ = device_loop(select_step, scores, root, iters=t.iters, repeats=t.repeats, donate=False)
    anchors = retrieval.select_chunks(scores, root, chunk, nsel, False)
    idx, _, _ = working_cache.history_indices(anchors, root, chunk, working_cache.history_slots(plan.spec))
    dcache = st.draft_cache
    st = st.replace(draft_cache=None)
    del kc, ret
    stats["gather_rope_write"], _ = device_loop(lambda c, i: working_cache.gather_rope_write(dcfg, c, i), dcache,
                                                idx, iters=t.iters, repeats=t.repeats, donate=True)
    stats["gather_rows"] = {"rows_per_sequence": int(idx.shape[1])}
    del st, dcache
    gc.collect()

    return _derived(out, stats, tc, ctx, batch, args)


def self_draft_case(target, ctx, batch, dec_s, args) -> dict:
    """Self-drafting at one (context, batch), per working-set budget: one self-draft step, the K proposals (working
    set appended, as on most cycles), a rebuild (gather of the whole history, after a new selection), the retrieval
    call and a whole cycle (state donated; the committed length is put back after each), and projections against
    the target's decode step ``dec_s``."""
    from diffspec_jax import engine, working_set
    from diffspec_jax.config import SamplingConfig, SpecConfig
    from diffspec_jax.engine.self_draft import SelfDrafter, self_draft_spec, self_propose
    from diffspec_jax.models import llama

    tc, k, t = target.config, args.k, args
    active = jnp.ones((batch,), bool)
    length = np.full((batch,), ctx, np.int32)
    acceptance = self_acceptance(args.self_acceptance)
    out = {}
    for budget in [int(x) for x in args.self_budgets.split(",")]:
        spec = self_draft_spec(SpecConfig.from_flat(dict(num_speculative_tokens=k, draft_context_policy="diffspec",
                                                         diffspec_chunk_size=args.chunk, diffspec_token_budget=budget,
                                                         diffspec_retrieval_interval=args.interval)), tc)
        plan = engine.Plan(target=tc, draft=None, spec=spec, sampling=SamplingConfig(), aux_layers=(),
                           capacity=ctx + 64 * (k + 1) + 64, drafter=SelfDrafter())
        fns, stats = engine.compiled(plan), {}
        holder = {"s": _filled_state(plan, batch, ctx)}
        for _ in range(2):  # a verification fills the scoring query and LSE; then a selection, and its rebuild
            s, *_ = fns.cycle(target.params, None, holder["s"], active)
            holder["s"] = s.replace(length=jnp.asarray(length))
            holder["s"], _ = fns.retrieve(target.params, None, holder["s"], active)
        del s

        def ret_call(holder=holder):
            holder["s"], anchors = fns.retrieve(target.params, None, holder["s"], active)
            return anchors

        stats["retrieve"] = pipelined(ret_call, repeats=t.repeats, inner=t.inner)
        st = holder.pop("s")
        ws, hb = st.draft_cache, spec.history_budget
        step = jax.jit(functools.partial(llama.step, tc), donate_argnums=(1,))
        cache = {"c": st.target_cache.replace(k=ws.k, v=ws.v)}
        toks, rows = jnp.ones((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32)
        start, pos = jnp.full((batch,), hb, jnp.int32), jnp.full((batch, 1), ctx, jnp.int32)

        def step_call(c=cache):
            o, c["c"] = step(target.params, c["c"], toks, start, rows, rope_positions=pos)
            return o.logits

        stats["self_step"] = pipelined(step_call, repeats=t.repeats, inner=t.inner)
        st = st.replace(draft_cache=ws.replace(k=cache["c"].k, v=cache["c"].v))
        del cache, step_call

        def prop(params, slim, dcache, key):  # params an argument: a closure would embed 16 GB of constants
            drafts, _, new, *_ = self_propose(plan, params, slim.replace(draft_cache=dcache), active, key)
            return drafts, new

        propose = jax.jit(prop, donate_argnums=(2,))
        ph = {"dc": st.draft_cache}
        slim = st.replace(draft_cache=None)

        def prop_call(propose=propose, slim=slim):
            drafts, ph["dc"] = propose(target.params, slim, ph["dc"], jax.random.PRNGKey(0))
            return drafts

        stats["self_propose"] = pipelined(prop_call, repeats=t.repeats, inner=t.inner)
        anchors = st.retrieval.anchors
        stats["rebuild"], dc = device_loop(
            lambda w, c: working_set.rebuild(w, c[0], c[1], c[2], args.chunk), ph.pop("dc"),
            (st.target_cache, anchors, st.length), iters=t.iters, repeats=t.repeats, donate=True)
        del slim, prop_call, propose
        cyc, _ = _time_cycle(fns, target.params, None, st.replace(draft_cache=dc), active, ctx, t)
        stats["cycle"], stats["cycle_blocking"] = cyc["pipelined"], cyc["blocking"]
        del st, dc, cyc
        gc.collect()
        row = {name + "_s": v["median_s"] for name, v in stats.items()}
        row["stats"] = stats
        row["working_set_slots"] = working_set.width(spec)
        row["self_step_over_target_step"] = row["self_step_s"] / dec_s
        row["cycle_with_retrieval_s"] = cycle_with_retrieval(row, args.interval)
        row["projected_speedup"] = {str(a): a * dec_s / row["cycle_with_retrieval_s"] for a in PROJECTION_ACCEPTANCE}
        if acceptance:  # recent: the same cycle without retrieval and rebuilds
            proj = project({**row, "target_step_s": dec_s}, {**acceptance, "interval": args.interval})
            row["projected_speedup_measured_acceptance"] = {
                "acceptance": acceptance, "self-diffspec": proj["self-diffspec"], "self-recent": proj["self-recent"]}
        out[str(budget)] = row
    return out


@functools.lru_cache(maxsize=4)
def self_acceptance(path: str | None) -> dict | None:
    """Mean acceptance of ``self-diffspec`` and ``self-recent`` at the longest context of a ``paired.py --draft
    self`` JSON (``None`` when there is none)."""
    try:
        acc = acceptance_of(Path(path) if path else SELF_PAIRED)
        return {k: acc[k] for k in ("self-diffspec", "self-recent", "context", "workload", "source")}
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _derived(out, stats, tc, ctx, batch, args):
    """Seconds per component, retrieval shares and projections (what was measured), and the bytes of a decode
    step."""
    k = args.k
    for name, s in stats.items():
        if "median_s" in s:
            out[name + "_s"] = s["median_s"]
    out["verify_over_decode"] = out["target_verify_step_s"] / out["target_decode_step_s"]
    if "cycle_full_s" not in out:  # --steps-only
        return _bytes(out, tc, ctx, batch)
    n = args.interval
    out["cycle_diffspec_with_retrieval_s"] = out["cycle_diffspec_s"] + out["retrieve_s"] / n
    work = (out["chunk_scores_s"] + out["selection_s"]) / n + out["gather_rope_write_s"]
    out["retrieval_work_per_cycle_s"] = work
    out["retrieval_share_of_cycle"] = work / out["cycle_diffspec_with_retrieval_s"]
    out["retrieval_share_dispatched"] = ((out["retrieve_s"] / n + out["gather_rope_write_s"])
                                         / out["cycle_diffspec_with_retrieval_s"])
    out["draft_per_token_full_s"] = out["draft_propose_full_s"] / k
    out["draft_per_token_diffspec_s"] = out["draft_propose_diffspec_s"] / k
    dec = out["target_decode_step_s"]
    out["projected_speedup"] = {
        str(a): {"full": a * dec / out["cycle_full_s"], "diffspec": a * dec / out["cycle_diffspec_with_retrieval_s"]}
        for a in PROJECTION_ACCEPTANCE}
    demo = demo_acceptance()
    if demo:
        out["projected_speedup_demo_acceptance"] = {
            "acceptance": demo, "full": demo["eagle3-full"] * dec / out["cycle_full_s"],
            "diffspec": demo["diffspec"] * dec / out["cycle_diffspec_with_retrieval_s"]}
    return _bytes(out, tc, ctx, batch)


def _bytes(out, tc, ctx, batch):
    """The bytes a decode step must move (the HBM floor's numerator): every weight but the embedding table (B rows
    of it are read) + K and V up to the context."""
    embed = tc.vocab_size * tc.hidden_size
    kv_per_token = 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 2
    out["weight_bytes_read"] = (tc.num_parameters - embed + batch * tc.hidden_size) * 2
    out["kv_bytes_read"] = kv_per_token * ctx * batch
    out["decode_step_bytes"] = out["weight_bytes_read"] + out["kv_bytes_read"]
    return out


def prefill_flops(tc, ctx: int, batch: int) -> dict[str, float]:
    """FLOPs a causal prefill of ``batch`` prompts of ``ctx`` tokens needs for its one output row per prompt:
    every layer's matrix products over every token (2 x weights x tokens) and causal attention (QK^T and PV over
    the causal half), except the last layer, which needs the K/V projections of every token but its query, output
    projection, MLP and attention for the output row alone (what :func:`diffspec_jax.models.llama.step` computes),
    and the LM head on that row."""
    h, i, d = tc.hidden_size, tc.intermediate_size, tc.head_dim
    hq, hkv, n = tc.num_attention_heads, tc.num_key_value_heads, tc.num_hidden_layers
    kv, rest = 2 * h * hkv * d, 2 * h * hq * d + 3 * h * i   # K/V projections; q + o projections and the MLP
    linear = 2 * batch * ((n - 1) * ctx * (kv + rest) + ctx * kv + rest + h * tc.vocab_size)
    attention = 4 * hq * d * batch * ((n - 1) * ctx * (ctx + 1) / 2 + ctx)
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def prefill_case(target, ctx: int, batch: int, peak: float, args) -> dict:
    """Prefill through the public ``generate()`` (target-only, ``max_new_tokens=1``: prefill + the first token),
    the second of two calls (the first compiles); TFLOP/s against the matrix-product peak of the same run."""
    from diffspec_jax import generate
    from diffspec_jax.target import plan_prefill

    rng = np.random.default_rng(ctx + batch)
    prompts = [rng.integers(0, target.config.vocab_size, ctx).tolist() for _ in range(batch)]
    runs = []
    for _ in range(1 + max(1, args.prefill_repeats)):
        t0 = time.perf_counter()
        res = generate(target, None, prompts, max_new_tokens=1, stop_token_ids=())
        runs.append({"wall_s": time.perf_counter() - t0, "prefill_s": res.stats.prefill_s,
                     "compile_s": getattr(res.stats, "compile_s", None)})
    timed = runs[1:]
    wall = statistics.median(r["wall_s"] for r in timed)
    flops = prefill_flops(target.config, ctx, batch)
    width, n_chunks = plan_prefill([ctx] * batch)
    return {"context": ctx, "batch": batch, "chunk_width": width, "chunks": n_chunks, "runs": runs,
            "prefill_s": wall, "flops": flops, "tflop_per_s": flops["total"] / wall / 1e12,
            "fraction_of_matmul_peak": flops["total"] / wall / peak,
            "floor_s_at_matmul_peak": flops["total"] / peak}


@functools.lru_cache(maxsize=1)
def demo_acceptance() -> dict | None:
    """Mean acceptance of ``eagle3-full``, ``eagle3-recent`` and ``diffspec`` on the demo pair at its longest
    context (paired.py)."""
    try:
        data = json.loads(DEMO_PAIRED.read_text())
        case = max(data["cases"], key=lambda c: c["context"])
        acc = {m: case["methods"][m]["mean_acceptance_length"]["median"] for m in ("eagle3-full", "diffspec")}
        if "eagle3-recent" in case["methods"]:
            acc["eagle3-recent"] = case["methods"]["eagle3-recent"]["mean_acceptance_length"]["median"]
        return {**acc, "context": case["context"], "source": str(DEMO_PAIRED.relative_to(REPO))}
    except (OSError, KeyError, ValueError, TypeError):
        return None


# ----------------------------------------------------------------------------------------------- peer
def _to_transformers(tcfg, params, dev):
    """A transformers Llama (bf16, sdpa) on ``dev`` holding ``params`` (JAX layout), converted with the loader's
    own parameter table (DLPack where it works, else through the host)."""
    import tempfile

    import torch
    import transformers

    from diffspec_jax.models import llama
    from diffspec_jax.models import params as tables

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps({**tcfg.to_hf_dict(), "dtype": "bfloat16"}))
        hf_cfg = transformers.AutoConfig.from_pretrained(d)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    model.eval()
    sd = model.state_dict()
    rows = {p.hf: p for p in llama.param_table(tcfg)}
    missing = sorted(set(sd) - set(rows))
    if missing:
        raise RuntimeError(f"transformers parameters without a source: {missing[:5]}")
    how = "dlpack"
    for name, m in rows.items():
        src = tables.get_leaf(params, m.path)
        try:
            tens = torch.from_dlpack(src)
        except Exception:  # noqa: BLE001 - any DLPack refusal: go through the host
            how = "host copy"
            tens = torch.from_numpy(np.asarray(jax.device_get(src)).view(np.uint16)).view(torch.bfloat16)
        with torch.no_grad():
            sd[name].copy_(m.transform.save(tens, m.shape))
        del tens
    if dev == "cuda":
        torch.cuda.synchronize()
    return model, how


def _peer_context(model, vocab, ctx, args):
    """transformers decoding at context ``ctx``, batch 1: eager (dynamic cache) and, with ``--peer-compiled``,
    StaticCache + torch.compile(mode="reduce-overhead", fullgraph=True)."""
    import inspect

    import torch
    import transformers

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    params = inspect.signature(model.forward).parameters
    ckw = "past_key_values" if "past_key_values" in params else "cache"  # transformers renamed it after 5.17
    res = {"context": ctx, "batch": 1, "cache_kwarg": ckw}
    steps, warm = args.peer_tokens, 3
    torch.manual_seed(ctx)
    ids = torch.randint(0, vocab, (1, ctx), device=dev)
    with torch.no_grad():
        dyn = transformers.DynamicCache(config=model.config)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{ckw: dyn})
        tok = out.logits[:, -1:].argmax(-1)
        sync()
        res["eager_prefill_s"] = time.perf_counter() - t0  # the first call: includes the libraries' warm-up
        del out, dyn
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        dyn = transformers.DynamicCache(config=model.config)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{ckw: dyn})
        tok = out.logits[:, -1:].argmax(-1)
        sync()
        res["eager_prefill_warm_s"] = time.perf_counter() - t0
        for _ in range(warm):
            tok = model(input_ids=tok, use_cache=True, **{ckw: dyn}).logits[:, -1:].argmax(-1)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = model(input_ids=tok, use_cache=True, **{ckw: dyn}).logits[:, -1:].argmax(-1)
        sync()
        res["eager_s_per_token"] = (time.perf_counter() - t0) / steps
        res["eager_tokens_timed"] = steps
        if args.peer_compiled:
            # the static cache takes the prompt's K/V from the dynamic one (a second 128K prefill into a static
            # cache would build a [T, max_len] mask); decode cost does not depend on where the values came from
            static = transformers.StaticCache(config=model.config, max_cache_len=ctx + steps + 2 * warm + 64)
            for i, layer in enumerate(dyn.layers):  # StaticLayer.update: lazy allocation + write at 0..ctx-1
                static.layers[i].update(layer.keys[:, :, :ctx], layer.values[:, :, :ctx])
            del dyn, out
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            res["compiled_max_cache_len"] = static.layers[0].max_cache_len
            for fullgraph in (True, False):
                try:
                    fwd = torch.compile(model, mode="reduce-overhead", fullgraph=fullgraph, dynamic=False)

                    def dec(tok, fwd=fwd):
                        if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                            torch.compiler.cudagraph_mark_step_begin()
                        return fwd(input_ids=tok, use_cache=True, **{ckw: static}).logits[:, -1:].argmax(-1)

                    t0 = time.perf_counter()
                    tok = dec(tok)
                    sync()
                    res["compile_s"] = time.perf_counter() - t0
                    res["fullgraph"] = fullgraph
                    break
                except Exception as e:  # noqa: BLE001 - record and retry without fullgraph
                    res[f"compile_error_fullgraph_{fullgraph}"] = f"{type(e).__name__}: {e}"[:500]
                    torch._dynamo.reset()
            else:
                return res
            for _ in range(warm):
                tok = dec(tok)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = dec(tok)
            sync()
            res["compiled_s_per_token"] = (time.perf_counter() - t0) / steps
            del static, fwd, dec
        torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def peer_worker(args) -> int:
    """Child process: rebuild the target's weights, move them into transformers, decode at each context."""
    import torch

    tcfg, _ = shapes(args.quick)
    target = random_target(tcfg, fuse_projections=False)  # the layout the transformers tensor maps read
    hashes = weight_hashes(target.params)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model, how = _to_transformers(tcfg, target.params, dev)
    del target
    gc.collect()
    print(PEER_PREFIX + json.dumps({"weights": {"sha256": hashes, "conversion": how, "device": dev,
                                                "load_s": time.perf_counter() - t0}}), flush=True)
    for ctx in (int(x) for x in args.contexts.split(",")):
        try:
            res = _peer_context(model, tcfg.vocab_size, ctx, args)
        except Exception as e:  # noqa: BLE001 - report and go on with the next context
            res = {"context": ctx, "batch": 1, "error": f"{type(e).__name__}: {e}"[:1000]}
        print(PEER_PREFIX + json.dumps(res), flush=True)
    return 0


def run_peer(contexts, args, parent_hashes, log) -> tuple[list[dict], dict]:
    """Run :func:`peer_worker` in a child process; returns its per-context rows (as many as finished in time)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-worker", "--contexts",
           ",".join(str(c) for c in contexts), "--peer-tokens", str(args.peer_tokens)]
    cmd += ["--peer-compiled"] if args.peer_compiled else []
    cmd += ["--quick"] if args.quick else []
    env = dict(os.environ, XLA_PYTHON_CLIENT_ALLOCATOR="platform")  # the child's JAX frees what it frees
    rows, info = [], {"command": " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))

    def stop():  # a watchdog: the child may also hang without printing
        info["stopped"] = f"peer timeout {args.peer_timeout_s:g}s"
        proc.kill()

    watchdog = threading.Timer(args.peer_timeout_s, stop)
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(PEER_PREFIX):
                item = json.loads(line[len(PEER_PREFIX):])
                if "weights" in item:
                    info["weights"] = item["weights"]
                    info["weights"]["same_as_ours"] = item["weights"]["sha256"] == parent_hashes
                else:
                    rows.append(item)
                    log(rows)
                print("peer:", line[len(PEER_PREFIX):].strip(), flush=True)
            else:
                print(line, end="", flush=True)
    finally:
        watchdog.cancel()
        proc.wait()
    info["returncode"] = proc.returncode
    info["wall_s"] = time.perf_counter() - t0
    return rows, info


# ------------------------------------------------------------------------------------- report + figure
def finalize(payload: dict) -> dict:
    """Peer ratios, the issue's targets (met / not met with numbers) and a compact summary table."""
    cases = {(c["context"], c["batch"]): c for c in payload["cases"]}
    payload["not_run"] = [r for r in payload.get("not_run", [])
                          if "prefill_error" in r or (r.get("context"), r.get("batch")) not in cases]
    for c in cases.values():  # files written before the field existed: the bandwidth their floor was computed with
        c.setdefault("copy_bandwidth_bytes_per_s", c["decode_step_bytes"] / c["hbm_floor_s"])
    payload["peer"].sort(key=lambda p: (p["batch"], p["context"]))
    for p in payload["peer"]:
        ours = cases.get((p["context"], p["batch"]))
        if ours is None:
            continue
        p["ours_decode_step_s"] = ours["target_decode_step_s"]
        for kind in ("eager", "compiled"):
            if f"{kind}_s_per_token" in p:
                p[f"ratio_{kind}_over_ours"] = p[f"{kind}_s_per_token"] / ours["target_decode_step_s"]
    targets = {}
    c64 = cases.get((65536, 1))
    peer64 = next((p for p in payload["peer"] if p["context"] == 65536 and p["batch"] == 1), {})
    if c64:
        r = c64["decode_step_over_floor"]
        targets["decode_64k_b1_within_1.3x_of_hbm_floor"] = {"value": r, "met": r <= TARGET_FLOOR_RATIO}
    for kind, need in (("compiled", TARGET_VS_COMPILED), ("eager", TARGET_VS_EAGER)):
        r = peer64.get(f"ratio_{kind}_over_ours")
        if r is not None:
            targets[f"decode_64k_b1_vs_transformers_{kind}_ge_{need:g}x"] = {"value": r, "met": r >= need}
    full = {key: c for key, c in cases.items() if "draft_propose_diffspec_s" in c}  # not --steps-only
    for b in sorted({b for _, b in full}):
        ctxs = sorted(c for c, bb in full if bb == b)
        if len(ctxs) < 2:
            continue
        lo, hi = full[(ctxs[0], b)], full[(ctxs[-1], b)]
        ds = hi["draft_propose_diffspec_s"] / lo["draft_propose_diffspec_s"]
        fs = hi["draft_propose_full_s"] / lo["draft_propose_full_s"]
        targets[f"diffspec_draft_flat_b{b}_{ctxs[0]}_to_{ctxs[-1]}"] = {
            "diffspec_ratio": ds, "full_ratio": fs, "met": ds <= TARGET_DRAFT_FLAT and fs > TARGET_DRAFT_FLAT,
            "complete": ctxs[0] == 8192 and ctxs[-1] == 131072}
    if full:
        worst = max(full.values(), key=lambda c: c["retrieval_share_of_cycle"])
        targets["scoring_selection_gather_le_5pct_of_cycle"] = {
            "max_share": worst["retrieval_share_of_cycle"], "at": [worst["context"], worst["batch"]],
            "max_share_dispatched": max(c["retrieval_share_dispatched"] for c in full.values()),
            "met": worst["retrieval_share_of_cycle"] <= TARGET_RETRIEVAL_SHARE}
    if cases:
        for c in cases.values():
            c.setdefault("verify_over_decode", c["target_verify_step_s"] / c["target_decode_step_s"])
        worst = max(cases.values(), key=lambda c: c["verify_over_decode"])
        targets[f"verify_step_le_{TARGET_VERIFY_OVER_DECODE:g}x_decode_step"] = {
            "max_ratio": worst["verify_over_decode"], "at": [worst["context"], worst["batch"]],
            "per_case": {f"{c['context']}x{c['batch']}": round(c["verify_over_decode"], 3)
                         for c in sorted(cases.values(), key=lambda c: (c["batch"], c["context"]))},
            "met": worst["verify_over_decode"] <= TARGET_VERIFY_OVER_DECODE}
    _prefill_targets(payload, targets)
    c648 = cases.get((65536, 8), {}).get("self_draft", {}).get("2048")
    if c648:
        r = c648["self_step_over_target_step"]
        targets[f"self_step_2k_le_{TARGET_SELF_STEP_SHARE:g}x_target_step_64k_b8"] = {
            "value": r, "met": r <= TARGET_SELF_STEP_SHARE}
    payload["targets"] = targets
    ms = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
    us = lambda x: None if x is None else round(x * 1e6, 1)  # noqa: E731
    payload["summary_ms"] = [
        {"context": c["context"], "batch": c["batch"], "decode": ms(c["target_decode_step_s"]),
         "decode_again": ms(c["target_decode_step_again_s"]) if "target_decode_step_again_s" in c else None,
         "hbm_floor": ms(c["hbm_floor_s"]), "over_floor": round(c["decode_step_over_floor"], 3),
         "verify": ms(c["target_verify_step_s"]), "verify_over_decode": round(c["verify_over_decode"], 3),
         "draft_full": ms(c.get("draft_propose_full_s")), "draft_diffspec": ms(c.get("draft_propose_diffspec_s")),
         "scores_us": us(c.get("chunk_scores_s")), "selection_us": us(c.get("selection_s")),
         "gather_us": us(c.get("gather_rope_write_s")), "retrieve_call_us": us(c.get("retrieve_s")),
         "retrieval_share_pct": round(100 * c["retrieval_share_of_cycle"], 2) if c in full.values() else None,
         "cycle_full": ms(c.get("cycle_full_s")), "cycle_diffspec": ms(c.get("cycle_diffspec_with_retrieval_s")),
         "speedup_at_3": {k: round(v, 2) for k, v in c["projected_speedup"]["3.0"].items()}
         if "projected_speedup" in c else None,
         "self": {b: {"step": ms(r["self_step_s"]), "step_over_decode": round(r["self_step_over_target_step"], 3),
                      "cycle": ms(r["cycle_with_retrieval_s"]),
                      "speedup_measured": {m: round(v, 2) for m, v in
                                           r.get("projected_speedup_measured_acceptance", {}).items()
                                           if m != "acceptance"} or None}
                  for b, r in c["self_draft"].items()} if "self_draft" in c else None}
        for c in sorted(cases.values(), key=lambda c: (c["batch"], c["context"]))]
    payload["rechecks_summary_ms"] = [
        {"context": c["context"], "batch": c["batch"], "decode": ms(c["target_decode_step_s"]),
         "decode_again": ms(c["target_decode_step_again_s"]), "verify": ms(c["target_verify_step_s"]),
         "over_floor": round(c["decode_step_over_floor"], 3), "draft_diffspec": ms(c.get("draft_propose_diffspec_s")),
         "cycle_diffspec": ms(c.get("cycle_diffspec_with_retrieval_s"))} for c in payload.get("rechecks", [])]
    return payload


def _prefill_targets(payload: dict, targets: dict) -> None:
    """Prefill rows joined with the peer's warm eager prefill; issue 22's prefill targets."""
    peer = {(p["context"], p["batch"]): p for p in payload["peer"] if "error" not in p}
    for r in payload.get("prefill", []):
        theirs = peer.get((r["context"], r["batch"]), {})
        t = theirs.get("eager_prefill_warm_s", theirs.get("eager_prefill_s"))
        if t is not None:
            r["transformers_eager_prefill_s"] = t
            r["transformers_over_ours"] = t / r["prefill_s"]
    rows = {(r["context"], r["batch"]): r for r in payload.get("prefill", [])}
    r64 = rows.get((65536, 1))
    if r64:
        targets[f"prefill_64k_b1_le_{TARGET_PREFILL_64K_S:g}s"] = {
            "value": r64["prefill_s"], "met": r64["prefill_s"] <= TARGET_PREFILL_64K_S,
            "transformers_eager_s": r64.get("transformers_eager_prefill_s"),
            "faster_than_transformers_eager": r64.get("transformers_over_ours", 0) > 1}
    b1 = [r for (c, b), r in sorted(rows.items()) if b == 1 and 8192 <= c <= 131072]
    if b1:
        worst = min(b1, key=lambda r: r["fraction_of_matmul_peak"])
        targets[f"prefill_ge_{TARGET_PREFILL_PEAK_FRACTION:g}_of_matmul_peak_8k_to_128k"] = {
            "min_fraction": worst["fraction_of_matmul_peak"], "at": worst["context"],
            "per_context": {r["context"]: round(r["fraction_of_matmul_peak"], 3) for r in b1},
            "complete": {r["context"] for r in b1} >= {8192, 32768, 65536, 131072},
            "met": worst["fraction_of_matmul_peak"] >= TARGET_PREFILL_PEAK_FRACTION}


def plot(payload: dict, path: Path) -> str | None:
    """Four panels: draft time (full store vs working cache), target decode vs HBM floor, the transformers peer,
    and the retrieval share of a cycle. Returns the file name, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", flush=True)
        return None
    cases = payload["cases"]
    batches = sorted({c["batch"] for c in cases})
    colors = {b: f"C{i}" for i, b in enumerate(batches)}
    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))

    def series(b, key, scale=1e3):
        rows = sorted((c for c in cases if c["batch"] == b), key=lambda c: c["context"])
        return [c["context"] for c in rows], [c[key] * scale for c in rows]

    full = all("draft_propose_full_s" in c for c in cases)  # else --steps-only: prefill and verify panels
    for b in batches:
        if full:
            x, y = series(b, "draft_propose_full_s")
            ax[0, 0].plot(x, y, "o-", color=colors[b], label=f"full store (EAGLE-3), batch {b}")
            x, y = series(b, "draft_propose_diffspec_s")
            ax[0, 0].plot(x, y, "s--", color=colors[b], label=f"working cache (DiffSpec), batch {b}")
            x, y = series(b, "retrieval_share_of_cycle", 100)
            ax[1, 1].plot(x, y, "o-", color=colors[b], label=f"batch {b}")
        else:
            x, y = series(b, "verify_over_decode", 1)
            ax[1, 1].plot(x, y, "o-", color=colors[b], label=f"batch {b}")
        x, y = series(b, "target_decode_step_s")
        ax[0, 1].plot(x, y, "o-", color=colors[b], label=f"decode step, batch {b}")
        x, y = series(b, "target_verify_step_s")
        ax[0, 1].plot(x, y, "^--", color=colors[b], label=f"verify step (K + 1 tokens), batch {b}")
        x, y = series(b, "hbm_floor_s")
        ax[0, 1].plot(x, y, ":", color=colors[b], label=f"HBM floor, batch {b}")
    k = payload["settings"]["k"]
    if full:
        ax[0, 0].set(title=f"Draft: K = {k} proposals per cycle", ylabel="ms")
        ax[1, 1].axhline(100 * TARGET_RETRIEVAL_SHARE, color="gray", ls=":", label="target 5%")
        ax[1, 1].set(title=f"Scoring + selection (every {payload['settings']['interval']} cycles) + gather",
                     ylabel="% of a DiffSpec cycle")
    else:
        reference_line(ax[1, 1], "1.0x (verify as fast as decode)")
        ax[1, 1].axhline(TARGET_VERIFY_OVER_DECODE, color="gray", ls=":", label=f"target {TARGET_VERIFY_OVER_DECODE}x")
        ax[1, 1].set(title=f"Verify step (K = {k}) / decode step", ylabel="ratio")
        pre = sorted((r for r in payload.get("prefill", []) if r["batch"] == 1), key=lambda r: r["context"])
        if pre:
            x = [r["context"] for r in pre]
            ax[0, 0].plot(x, [r["prefill_s"] for r in pre], "o-", color="C0", label="diffspec_jax generate()")
            ax[0, 0].plot(x, [r["floor_s_at_matmul_peak"] for r in pre], ":", color="C0",
                          label="FLOP floor at the measured matmul peak")
            theirs = [(r["context"], r["transformers_eager_prefill_s"]) for r in pre
                      if "transformers_eager_prefill_s" in r]
            if theirs:
                ax[0, 0].plot([t[0] for t in theirs], [t[1] for t in theirs], "s-", color="C3",
                              label="transformers eager (sdpa)")
            for r in pre:
                ax[0, 0].annotate(f"{100 * r['fraction_of_matmul_peak']:.0f}%", (r["context"], r["prefill_s"]),
                                  textcoords="offset points", xytext=(4, -10), fontsize=8)
            ax[0, 0].set_yscale("log")
            log_yticks(ax[0, 0])
        ax[0, 0].set(title="Prefill, batch 1 (labels: share of the matmul peak)", ylabel="seconds")
    if any("self_draft" in c for c in cases):  # --draft self: the self-draft step beside the target's decode step
        ax[0, 0].clear()
        for b in batches:
            rows = sorted((c for c in cases if c["batch"] == b and "self_draft" in c), key=lambda c: c["context"])
            x = [c["context"] for c in rows]
            ax[0, 0].plot(x, [c["target_decode_step_s"] * 1e3 for c in rows], "o-", color=colors[b],
                          label=f"target decode step, batch {b}")
            for i, budget in enumerate(rows[0]["self_draft"] if rows else ()):
                ax[0, 0].plot(x, [c["self_draft"][budget]["self_step_s"] * 1e3 for c in rows], ("s", "x")[i % 2] + "--",
                              color=colors[b], label=f"self-draft step, budget {budget}, batch {b}")
        ax[0, 0].set(title="Self-draft step (target over its working set) vs target step", ylabel="ms")
    ax[0, 1].set(title="Target decode step vs HBM floor", ylabel="ms")
    peers = sorted((p for p in payload["peer"] if "ours_decode_step_s" in p), key=lambda p: p["context"])
    if peers:
        x = [p["context"] for p in peers]
        ax[1, 0].plot(x, [p["ours_decode_step_s"] * 1e3 for p in peers], "o-", color="C0", label="diffspec_jax")
        floor = {c["context"]: c["hbm_floor_s"] for c in cases if c["batch"] == 1}
        xf = [p["context"] for p in peers if p["context"] in floor]
        ax[1, 0].plot(xf, [floor[p["context"]] * 1e3 for p in peers if p["context"] in floor], ":", color="C0",
                      label="HBM floor")
        for kind, col in (("eager", "C3"), ("compiled", "C2")):
            pts = [(p["context"], p[f"{kind}_s_per_token"] * 1e3, p[f"ratio_{kind}_over_ours"])
                   for p in peers if f"{kind}_s_per_token" in p]
            if pts:
                label = ("transformers eager, dynamic cache" if kind == "eager"
                         else "transformers StaticCache + torch.compile")
                ax[1, 0].plot([p[0] for p in pts], [p[1] for p in pts], "s-", color=col, label=label)
                for px, py, r in pts:
                    ax[1, 0].annotate(f"{r:.1f}x", (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax[1, 0].set_yscale("log")
        log_yticks(ax[1, 0])
    ax[1, 0].set(title="Target-only decode, batch 1 (ratios: theirs / ours)", ylabel="ms per token")
    ticks = sorted({c["context"] for c in cases} | {p["context"] for p in peers})
    for a in ax.flat:
        context_axis(a, ticks)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    env = payload["environment"]
    fig.suptitle(f"Llama-3.1-8B-shaped target + EAGLE-3-shaped draft, random bf16 weights, {env['device']} "
                 f"(JAX {env['versions'].get('jax', '?')})", fontsize=10)
    return save_figure(fig, path, dpi=110)


def write(payload: dict, outs) -> None:
    """The figure (once there are cases) and the JSON (``outs``: their claimed output files)."""
    finalize(payload)
    payload["figure"] = plot(payload, outs[1]) if payload["cases"] else None
    write_json(outs[0], payload)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072", help="run in this order")
    ap.add_argument("--batches", default="1,8", help="batch 1 (and the peer) first, then the others")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10, help="calls dispatched back to back per timed repeat")
    ap.add_argument("--iters", type=int, default=50, help="iterations of the device loops (scoring, selection, "
                                                           "gather)")
    ap.add_argument("--max-kv-gib", type=float, default=100.0, help="skip (context, batch) whose KV exceeds this")
    ap.add_argument("--peer", action="store_true", help="transformers eager decode in a child process (batch 1)")
    ap.add_argument("--peer-compiled", action="store_true", help="also StaticCache + torch.compile")
    ap.add_argument("--peer-contexts", default=None, help="default: --contexts")
    ap.add_argument("--recheck", default="", help="CTX:B,...: measure these cases again (kept apart, under "
                                                  "'rechecks'), after everything else")
    ap.add_argument("--peer-after", type=int, default=None, help="run the peer after this many batch-1 cases")
    ap.add_argument("--peer-tokens", type=int, default=24)
    ap.add_argument("--peer-timeout-s", type=float, default=480.0)
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="start no case once this many seconds have passed (0 = no limit)")
    ap.add_argument("--resume", default=None, help="keep the cases and peer rows of this JSON and skip them")
    add_plot_only_argument(ap)
    ap.add_argument("--steps-only", action="store_true",
                    help="per case only the target's decode and verify steps (no draft, retrieval or cycles)")
    ap.add_argument("--prefill", action="store_true",
                    help="also time prefill through generate() per case (TFLOP/s against the matmul peak)")
    ap.add_argument("--prefill-repeats", type=int, default=1, help="timed prefill calls after the compiling one")
    ap.add_argument("--prefill-batches", default=None,
                    help="--prefill: time prefill only at these batch sizes (comma-separated; default: every batch)")
    ap.add_argument("--draft", default=None, choices=["self"],
                    help="self: measure self-drafting (the target over its working set) instead of the EAGLE-3 draft")
    ap.add_argument("--self-budgets", default="2048,4096", help="--draft self: working-set budgets (tokens)")
    ap.add_argument("--self-acceptance", default=None,
                    help=f"--draft self: a paired.py --draft self JSON whose acceptance the projections use "
                         f"(default {SELF_PAIRED.relative_to(REPO)})")
    ap.add_argument("--quick", action="store_true")
    add_output_arguments(ap, "benchmarks/results/long_context.json")
    args = ap.parse_args(argv)
    if args.draft == "self":  # the EAGLE-3 draft's parts are not measured
        args.steps_only = True
    if redraw(ap, args, plot, __file__, prepare=finalize):
        return 0
    if args.peer_worker:
        return peer_worker(args)
    t_start = time.perf_counter()
    if args.resume and Path(args.resume).resolve() == Path(args.out).resolve():
        args.overwrite = True  # continuing --out itself: its rows are carried over (an unmarked one is moved aside)
    out = claim_outputs(ap, args, [args.out, Path(args.out).with_suffix(".png")], __file__)
    tcfg, dcfg = shapes(args.quick)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    prefill_batches = {int(x) for x in (args.prefill_batches or "").split(",") if x.strip()}
    batches = sorted(batches, key=lambda b: b != 1)
    prev = json.loads(Path(args.resume).read_text()) if args.resume and Path(args.resume).exists() else None
    env = environment(sys.argv)
    env["script_sha256"] = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # the script may be uncommitted
    payload = {"benchmark": "long-context cycle anatomy", "note": RANDOM_NOTE, "environment": env,
               "runs": (prev or {}).get("runs", []) + [env], "settings": vars(args),
               "target_config": tcfg.to_hf_dict(), "draft_config": dcfg.to_hf_dict(),
               "weights": "random bfloat16 (normal, std 0.02), seed 0 (target) / 1 (draft)",
               "timing": {"pipelined": "calls dispatched back to back (state donated), one wait per repeat: "
                                       "what a decode loop sustains while the host keeps ahead",
                          "blocking": "one call, then a host sync (dispatch + sync latency included)",
                          "device loop": "calls inside one jitted fori_loop (no host dispatch)",
                          "hbm_floor": "decode_step_bytes / copy bandwidth (same run); bytes = every weight but "
                                       "the embedding table (B rows of it) + K/V of `context` tokens x 32 layers",
                          "retrieval_share_of_cycle": "((scoring + selection) / interval + gather) / (DiffSpec "
                                                      "cycle + retrieval call / interval), device times"},
               "projection_note": "speedup = acceptance length x target decode step / cycle time (DiffSpec: + the "
                                  "retrieval call amortised over the interval); the demo-acceptance projection uses "
                                  "the 6M-parameter demo pair's acceptance, indicative only",
               "cases": list((prev or {}).get("cases", [])), "skipped": [],
               "not_run": [r for r in (prev or {}).get("not_run", []) if "error" in r],
               "rechecks": list((prev or {}).get("rechecks", [])),
               "peer": list((prev or {}).get("peer", [])), "peer_runs": list((prev or {}).get("peer_runs", [])),
               "prefill": list((prev or {}).get("prefill", []))}
    done = {(c["context"], c["batch"]) for c in payload["cases"]}
    target = random_target(tcfg)
    dparams = random_draft(dcfg, target)
    hashes = weight_hashes(target.params)
    payload["weight_sha256"] = hashes
    if prev and prev.get("weight_sha256") not in (None, hashes):
        raise SystemExit("--resume: that file was measured with other weights")
    bw = copy_bandwidth(16 << 20 if args.quick else 2 << 30)
    payload["copy_bandwidth"] = bw
    if args.prefill:
        payload["matmul_peak"] = matmul_peak(256 if args.quick else 8192)
        print(f"bf16 matmul {payload['matmul_peak']['flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    print(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s; setup {time.perf_counter() - t_start:.1f}s",
          flush=True)
    kv_tok = 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim * 2

    def over_budget():
        return args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s

    def peer_phase():
        peer_done = {p["context"] for p in payload["peer"] if "error" not in p}
        want = [int(x) for x in (args.peer_contexts or args.contexts).split(",")]
        todo = [c for c in want if c not in peer_done and c * kv_tok / 2 ** 30 <= args.max_kv_gib]
        if not todo:
            return
        if over_budget():
            payload["not_run"].append({"peer_contexts": todo, "why": "--time-budget-s reached"})
            return
        payload["peer"] = [p for p in payload["peer"] if "error" not in p]
        base = list(payload["peer"])

        def log(rows):
            payload["peer"] = base + rows
            write(payload, out)

        rows, info = run_peer(todo, args, hashes, log)
        payload["peer"] = base + rows
        payload["peer_runs"].append(info)
        write(payload, out)

    work = [(ctx, b) for b in batches for ctx in contexts]
    if args.peer:  # after --peer-after batch-1 cases (default: all of them), before the larger batches
        n1 = sum(1 for _, b in work if b == 1)
        work.insert(min(args.peer_after, n1) if args.peer_after is not None else n1, "peer")
    work += [("recheck", int(x.split(":")[0]), int(x.split(":")[1])) for x in args.recheck.split(",") if x]
    measured = 0
    for item in work:
        if item == "peer":
            peer_phase()
            continue
        recheck = item[0] == "recheck"
        ctx, b = item[1:] if recheck else item
        if (ctx, b) in done and not recheck:
            continue
        kv_gib = kv_tok * ctx * b / 2 ** 30
        if kv_gib > args.max_kv_gib:
            payload["skipped"].append({
                "context": ctx, "batch": b, "kv_gib": kv_gib,
                "why": f"the target KV cache alone is {kv_gib:.0f} GiB (> --max-kv-gib {args.max_kv_gib:g}); "
                       f"with {tcfg.num_parameters * 2 / 2 ** 30:.0f} GiB of weights it does not fit in one "
                       f"GPU of ~139 GiB"})
            continue
        if over_budget():
            payload["not_run"].append({"context": ctx, "batch": b, "why": "--time-budget-s reached"})
            continue
        t0 = time.perf_counter()
        try:
            row = anatomy(target, dcfg, dparams, ctx, b, args)
            if args.draft == "self":
                row["self_draft"] = self_draft_case(target, ctx, b, row["target_decode_step_s"], args)
        except Exception as e:  # recorded; a failure before any case succeeded ends the run (fail fast)
            payload["not_run"].append({"context": ctx, "batch": b, "error": f"{type(e).__name__}: {e}"[:2000]})
            write(payload, out)
            if not measured:
                raise
            gc.collect()
            continue
        measured += 1
        row["copy_bandwidth_bytes_per_s"] = bw["bytes_per_s"]  # measured in this case's run
        row["hbm_floor_s"] = row["decode_step_bytes"] / bw["bytes_per_s"]
        row["decode_step_over_floor"] = row["target_decode_step_s"] / row["hbm_floor_s"]
        row["wall_seconds"] = time.perf_counter() - t0
        if args.prefill and not recheck and (not prefill_batches or b in prefill_batches) and not any(
                (r["context"], r["batch"]) == (ctx, b) for r in payload["prefill"]):
            gc.collect()
            try:
                pre = prefill_case(target, ctx, b, payload["matmul_peak"]["flop_per_s"], args)
                payload["prefill"].append(pre)
                print({k: v for k, v in pre.items() if k not in ("runs", "flops")}, flush=True)
            except Exception as e:  # noqa: BLE001 - recorded beside the case; the decode steps still count
                payload["not_run"].append({"context": ctx, "batch": b,
                                           "prefill_error": f"{type(e).__name__}: {e}"[:2000]})
            gc.collect()
        if recheck:
            payload["rechecks"].append(row)
        else:
            payload["cases"].append(row)
            payload["cases"].sort(key=lambda c: (c["batch"], c["context"]))
        write(payload, out)
        print({k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in row.items()
               if not isinstance(v, dict)}, flush=True)
        gc.collect()
    write(payload, out)
    for row in payload["summary_ms"]:
        print(row)
    print(json.dumps(payload["targets"], indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
