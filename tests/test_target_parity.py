"""Target logits against Hugging Face transformers (torch CPU, float32): forward, chunked prefill, cached steps."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ARCHS, check_cached_steps, hf_logits, rel_err
from diffspec_jax import forward, target as tgt
from diffspec_jax.cache import KVCache
from diffspec_jax.models.llama import DENSE_ATTENTION_MAX_TOKENS
from diffspec_jax.utils import CompileCounter

TOL = 1e-4
LENGTHS = (37, 300, 150)  # ragged; 300 > 4.5x the llama3 original context (64) of the tiny Llama


@pytest.fixture(scope="module")
def sequences():
    return np.random.default_rng(1234).integers(0, 256, size=(len(LENGTHS), 320))


@pytest.fixture(scope="module")
def reference(hf_models, sequences):
    return {arch: hf_logits(hf_models[arch], sequences) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_transformers(arch, targets, sequences, reference):
    ours = np.asarray(forward(targets[arch], sequences))
    assert ours.dtype == np.float32 and ours.shape == reference[arch].shape
    assert rel_err(ours, reference[arch]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_cached_steps_match_transformers(arch, targets, sequences, reference):
    """Ragged prefill in 128-token chunks (the tiled attention path), then T=1 and T=5 steps."""
    model, ref = targets[arch], reference[arch]
    assert 128 > DENSE_ATTENTION_MAX_TOKENS  # the chunks below take the tiled path
    cache = KVCache.create(model.config, len(LENGTHS), 400, jnp.float32)
    logits, cache = tgt.prefill(model, cache, [list(s[:n]) for s, n in zip(sequences, LENGTHS)], chunk=128)
    for b, n in enumerate(LENGTHS):
        assert rel_err(logits[b], ref[b, n - 1]) <= TOL
    check_cached_steps(model, cache, sequences, LENGTHS, ref, TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_equals_each_prompt_alone(arch, targets, sequences):
    model = targets[arch]
    prompts = [list(s[:n]) for s, n in zip(sequences, LENGTHS)]
    batch_cache = KVCache.create(model.config, 3, 320, jnp.float32)
    batch_logits, batch_cache = tgt.prefill(model, batch_cache, prompts, chunk=64)
    nxt = np.array([[p[-1]] for p in prompts])
    batch_step, _ = tgt.decode(model, batch_cache, nxt, [len(p) for p in prompts])
    for b, p in enumerate(prompts):
        cache = KVCache.create(model.config, 1, 320, jnp.float32)
        alone, cache = tgt.prefill(model, cache, [p], chunk=64)
        alone_step, _ = tgt.decode(model, cache, nxt[b:b + 1], [len(p)])
        np.testing.assert_allclose(batch_logits[b], alone[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(batch_step[b], alone_step[0], rtol=0, atol=1e-5)


def test_decode_steps_do_not_recompile(targets):
    model = targets["llama"]
    rng = np.random.default_rng(7)
    cache = KVCache.create(model.config, 2, 128, jnp.float32)
    _, cache = tgt.prefill(model, cache, [list(rng.integers(0, 256, 9)), list(rng.integers(0, 256, 4))])
    pos = np.array([9, 4])
    _, cache = tgt.decode(model, cache, rng.integers(0, 256, (2, 1)), pos)  # warm-up compile
    pos += 1
    with CompileCounter() as counter:
        for _ in range(24):
            _, cache = tgt.decode(model, cache, rng.integers(0, 256, (2, 1)), pos)
            pos += 1
    assert counter.count == 0


def test_bfloat16_params_track_float32(tiny_dirs, targets, sequences):
    from diffspec_jax import load_target

    bf16 = load_target(tiny_dirs["llama"])  # the default dtype
    assert bf16.dtype == jnp.bfloat16
    ours = np.asarray(forward(bf16, sequences[:1, :64]))
    assert ours.dtype == np.float32
    assert rel_err(ours, forward(targets["llama"], sequences[:1, :64])) < 5e-2
    # cached bf16 steps at batch 2, where XLA:CPU hands the attention products to its library dot (bf16 -> f32
    # products are widened there: layers._dot_operands)
    cache = KVCache.create(bf16.config, 2, 1024, jnp.bfloat16)
    _, cache = tgt.prefill(bf16, cache, [list(sequences[0, :60])] * 2)
    step = np.asarray(tgt.decode(bf16, cache, np.repeat(sequences[:1, 60:64], 2, 0), [60, 60])[0])
    assert rel_err(step, np.repeat(ours[:, 60:64], 2, 0)) < 5e-2


def test_forward_rejects_bad_token_ids(targets):
    from diffspec_jax.errors import InputError

    with pytest.raises(InputError, match=r"must lie in \[0, 256\)"):
        forward(targets["llama"], [[1, 2, 256]])
    with pytest.raises(InputError, match="empty"):
        forward(targets["llama"], np.zeros((1, 0), np.int32))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_equal_the_checkpoint_layout(arch, tiny_dirs, targets, sequences):
    """load_target serves fused q/k/v and gate/up weights (the other tests here check those against transformers);
    the checkpoint layout must give the same logits, round-trip exactly, and shard the same way (TP4 repeats each of
    the 2 KV heads on two shards: the fused groups are split, the separate k/v weights repeated)."""
    import jax

    from diffspec_jax import load_target, make_mesh
    from diffspec_jax.models import llama

    fused, plain = targets[arch], load_target(tiny_dirs[arch], dtype="float32", fuse_projections=False)
    assert {"wqkv", "w_gate_up"} <= set(fused.params["layers"][0]) and "wq" not in fused.params["layers"][0]
    assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(plain.params["layers"][0])
    back = llama.split_projections(fused.config, fused.params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, plain.params)
    ids = sequences[:2, :40]
    ref = np.asarray(forward(plain, ids))
    assert rel_err(forward(fused, ids), ref) <= 1e-5
    assert rel_err(forward(plain, ids, mesh=make_mesh(4)), ref) <= 1e-5
    assert rel_err(forward(fused, ids, mesh=make_mesh(4)), ref) <= 1e-5
    outs = []
    for model in (fused, plain):  # cached: prefill, then a 5-token verify step
        cache = KVCache.create(model.config, 2, 64, jnp.float32)
        _, cache = tgt.prefill(model, cache, [list(ids[0, :30]), list(ids[1, :17])])
        outs.append(np.asarray(tgt.decode(model, cache, ids[:, 30:35], [30, 17])[0]))
    assert rel_err(outs[0], outs[1]) <= 1e-5
