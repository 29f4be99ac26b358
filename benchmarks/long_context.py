"""Long-context cycle anatomy on production shapes, the HBM floor, and the transformers peer.

    python benchmarks/long_context.py --contexts 8192,32768,65536,131072 --batches 1,8 \\
        --out benchmarks/results/long_context_h200.json [--peer]

A Llama-3.1-8B-shaped target and an EAGLE-3-shaped draft with **random bfloat16 weights** (the shapes of the
public checkpoints): timings are valid, acceptance is meaningless, so speedups are *projected* from the measured
cycle times at given acceptance lengths (the demo pair's, measured by ``paired.py``, and published ones). Caches
are filled with random values instead of a prefill (the cost of a step does not depend on their contents).

Per (context, batch): device time of the target's decode step (1 token) and verify step (K + 1 tokens); the draft's
K proposals over its full store (plain EAGLE-3) and over the working cache (DiffSpec); chunk scoring, selection and
gather-RoPE-write; one whole cycle of each policy; the bytes a target decode step must move (weights + KV up to
the context) over the copy bandwidth measured in the same run (the HBM floor). ``--peer`` adds Hugging Face
``transformers`` (torch, sdpa) decoding the same weights at the same context in its two common forms: eager with
the default dynamic cache, and ``StaticCache`` + ``torch.compile(mode="reduce-overhead")``. ``--quick`` runs tiny
shapes anywhere (smoke test).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth, environment, write_json  # noqa: E402

#: published mean acceptance lengths used for projections (the Ascend plugin did not publish any; EAGLE-3 paper
#: figures for Llama-3.1-8B chat at short context are about 6 with trees; chains are lower)
PROJECTION_ACCEPTANCE = (1.5, 2.0, 3.0, 4.0)


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


def random_models(tcfg, dcfg, seed=0):
    """Random bf16 params made on the device (no host copy of 16 GB)."""
    from diffspec_jax.models import eagle3, llama
    from diffspec_jax.target import TargetModel

    def make(shapes_tree, key):
        leaves, tree = jax.tree_util.tree_flatten(shapes_tree, is_leaf=llama.is_shape)
        keys = jax.random.split(key, len(leaves))
        out = [jax.jit(functools.partial(lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(
            jnp.bfloat16), s=s))(k) for k, s in zip(keys, leaves)]
        return jax.tree_util.tree_unflatten(tree, out)

    tparams = make(llama.param_shapes(tcfg), jax.random.PRNGKey(seed))
    dshapes = eagle3.param_shapes(dcfg, num_aux=3)
    d2t = dshapes.pop("d2t")
    dparams = make(dshapes, jax.random.PRNGKey(seed + 1))
    used = np.sort(np.random.default_rng(seed).choice(dcfg.vocab_size, d2t[0], replace=False))
    dparams["d2t"] = jnp.asarray(used - np.arange(len(used)), jnp.int32)
    dparams["embed"] = tparams["embed"]
    return TargetModel(tcfg, tparams), dparams


def timed(fn, *args, repeats=10):
    """Median seconds of ``fn(*args)`` (blocking each call); the first call compiles and is not counted."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def anatomy(target, dcfg, dparams, ctx, batch, args):
    """Component and cycle times of one (context, batch)."""
    from diffspec_jax import engine, retrieval, working_cache
    from diffspec_jax.config import SamplingConfig, SpecConfig
    from diffspec_jax.models import llama
    from pallas_kernels import dispatch

    k = args.k
    tc = target.config
    cap = ctx + 64 * (k + 1) + 64
    out = {"context": ctx, "batch": batch}
    plans = {}
    for policy in ("full", "diffspec"):
        spec = SpecConfig(num_speculative_tokens=k, draft_context_policy=policy, diffspec_chunk_size=args.chunk,
                          diffspec_token_budget=args.budget)
        plans[policy] = engine.Plan(target=tc, draft=dcfg, spec=spec, sampling=SamplingConfig(),
                                    aux_layers=dcfg.aux_layer_ids, capacity=cap,
                                    kernels=dispatch.kernel_backend())
    key = jax.random.PRNGKey(1)

    def filled_state(plan):
        st = engine.init_state(plan, batch, jnp.bfloat16, jnp.bfloat16, 0)
        fill = jax.jit(lambda x, key: jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype),
                       donate_argnums=(0,))
        st = jax.tree_util.tree_map(lambda x: fill(x, key) if x.ndim >= 3 and x.dtype == jnp.bfloat16 else x, st)
        return st.replace(length=jnp.full((batch,), ctx, jnp.int32),
                          pend_count=jnp.ones((batch,), jnp.int32),
                          last_token=jnp.ones((batch,), jnp.int32))

    # target steps (state donated and reused: lengths stay at ctx, rewriting the same rows)
    st = filled_state(plans["full"])
    step = jax.jit(functools.partial(llama.step, tc), donate_argnums=(1,))
    for t, name in ((1, "target_decode_step_s"), (k + 1, "target_verify_step_s")):
        toks = jnp.ones((batch, t), jnp.int32)
        rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        holder = {"cache": st.target_cache}

        def run(toks=toks, rows=rows, holder=holder):
            o, holder["cache"] = step(target.params, holder["cache"], toks, st.length, rows)
            return o.logits

        out[name] = timed(run, repeats=args.repeats)
        st = st.replace(target_cache=holder["cache"])
    active = jnp.ones((batch,), bool)
    for policy, plan in plans.items():
        s = filled_state(plan) if policy == "diffspec" else st
        propose = jax.jit(functools.partial(engine.draft_propose, plan))
        out[f"draft_propose_{policy}_s"] = timed(lambda s=s: propose(dparams, s, active, key)[0], repeats=args.repeats)
        fns = engine.compiled(plan)
        holder = {"state": s}

        def cycle(fns=fns, holder=holder):
            holder["state"], emitted, *_ = fns.cycle(target.params, dparams, holder["state"], active)
            return emitted

        out[f"cycle_{policy}_s"] = timed(cycle, repeats=args.repeats)
        if policy == "diffspec":
            sd = holder["state"]
            kc = sd.target_cache.k[plan.score_layer]
            root = sd.length - 1
            q = jax.random.normal(key, (batch, tc.num_attention_heads, tc.head_dim), jnp.float32)
            lse = jnp.full((batch, tc.num_attention_heads), float(np.log(ctx)), jnp.float32)
            score = jax.jit(functools.partial(dispatch.chunk_scores, chunk=args.chunk))
            out["chunk_scores_s"] = timed(score, q, lse, kc, root, repeats=args.repeats)
            scores = score(q, lse, kc, root)
            select = jax.jit(functools.partial(retrieval.select_chunks, chunk=args.chunk,
                                               max_chunks=plan.spec.max_chunks, keep_sink=False))
            out["selection_s"] = timed(select, scores, root, repeats=args.repeats)
            idx, _, _ = working_cache.history_indices(select(scores, root), root, args.chunk,
                                                      working_cache.history_slots(plan.spec))
            grw = jax.jit(functools.partial(working_cache.gather_rope_write, dcfg))
            out["gather_rope_write_s"] = timed(grw, sd.draft_cache, idx, repeats=args.repeats)
            retrieve = fns.retrieve
            holder2 = {"state": sd}

            def ret(holder2=holder2, retrieve=retrieve):
                holder2["state"], anchors = retrieve(target.params, dparams, holder2["state"], active)
                return anchors

            out["retrieve_s"] = timed(ret, repeats=args.repeats)
    tb = tc.num_parameters * 2
    kv = 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 2 * ctx * batch
    out["decode_step_bytes"] = tb + kv
    n = args.interval
    retr = out["retrieve_s"] / n
    out["retrieval_share_of_cycle"] = retr / (out["cycle_diffspec_s"] + retr)
    out["projected_speedup"] = {
        str(a): {"full": a * out["target_decode_step_s"] / out["cycle_full_s"],
                 "diffspec": a * out["target_decode_step_s"] / (out["cycle_diffspec_s"] + retr)}
        for a in PROJECTION_ACCEPTANCE}
    return out


def peer(tcfg, target, ctx, batch, args):
    """transformers decoding of the same weights at the same context (eager dynamic cache; static + compiled)."""
    import tempfile

    import torch
    import transformers

    from checkpoints_tools.hf import save_hf

    res = {"context": ctx, "batch": batch}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, tcfg, target.params, dtype="bfloat16")
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa").to(dev).eval()
    ids = torch.randint(0, tcfg.vocab_size, (batch, ctx), device=dev)
    steps = args.peer_tokens
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        if dev == "cuda":
            torch.cuda.synchronize()
        res["eager_s_per_token"] = (time.perf_counter() - t0) / steps
        if args.peer_compiled:
            static = transformers.StaticCache(config=model.config, max_cache_len=ctx + steps + 8)
            pos = torch.arange(ctx, device=dev)
            out = model(ids, past_key_values=static, cache_position=pos, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            fwd = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            times = []
            for i in range(steps + 3):
                cp = torch.tensor([ctx + i], device=dev)
                t0 = time.perf_counter()
                out = fwd(tok, past_key_values=static, cache_position=cp, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                if dev == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res["compiled_s_per_token"] = float(np.median(times[3:]))
    del model
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-kv-gib", type=float, default=100.0, help="skip (context, batch) whose KV exceeds this")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--peer-compiled", action="store_true")
    ap.add_argument("--peer-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    args = ap.parse_args(argv)
    tcfg, dcfg = shapes(args.quick)
    target, dparams = random_models(tcfg, dcfg)
    bw = copy_bandwidth(16 << 20 if args.quick else 2 << 30)
    cases, peers, skipped = [], [], []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            kv_gib = 2 * tcfg.num_hidden_layers * tcfg.num_key_value_heads * tcfg.head_dim * 2 * ctx * b / 2 ** 30
            if kv_gib > args.max_kv_gib:
                skipped.append({"context": ctx, "batch": b, "kv_gib": kv_gib, "why": "KV cache exceeds --max-kv-gib"})
                continue
            row = anatomy(target, dcfg, dparams, ctx, b, args)
            row["hbm_floor_s"] = row["decode_step_bytes"] / bw["bytes_per_s"]
            row["decode_step_over_floor"] = row["target_decode_step_s"] / row["hbm_floor_s"]
            cases.append(row)
            print({k: (round(v * 1e3, 3) if k.endswith("_s") else v) for k, v in row.items()
                   if k != "projected_speedup"}, flush=True)
            if args.peer and b == 1:
                p = peer(tcfg, target, ctx, b, args)
                p["ours_decode_step_s"] = row["target_decode_step_s"]
                p["ratio_eager_over_ours"] = p["eager_s_per_token"] / row["target_decode_step_s"]
                if "compiled_s_per_token" in p:
                    p["ratio_compiled_over_ours"] = p["compiled_s_per_token"] / row["target_decode_step_s"]
                peers.append(p)
                print(p, flush=True)
    payload = {"benchmark": "long-context cycle anatomy (random weights: timings valid, acceptance meaningless)",
               "environment": environment(sys.argv), "settings": vars(args), "copy_bandwidth": bw,
               "target_config": tcfg.to_hf_dict(), "draft_config": dcfg.to_hf_dict(),
               "weights": "random bfloat16 (normal, std 0.02)", "cases": cases, "skipped": skipped, "peer": peers,
               "projection_note": "speedup = acceptance_length x target decode step / cycle time (+ retrieval "
                                  "amortised over the interval)"}
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
