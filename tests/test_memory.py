"""generate()'s memory accounting (diffspec_jax.engine.memory): the state's bytes against the arrays init_state
creates, the chunk sizing rule, and the up-front check (the device's memory statistics are faked: CPUs report
none). generate() itself under a fake limit is tested in test_engine.py, beside the calls it shares programs with."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints_tools.make_tiny import tiny_config
from diffspec_jax import make_mesh
from diffspec_jax.config import DraftConfig, ModelConfig, RopeConfig, SamplingConfig, SpecConfig
from diffspec_jax.engine import init_state, memory
from diffspec_jax.engine.propose import Eagle3Drafter
from diffspec_jax.engine.state import Plan
from diffspec_jax.errors import InputError, OutOfMemoryError
from diffspec_jax.target import abstract_params

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=4096, rope=RopeConfig(theta=500000.0))
DRAFT = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    vocab_size=512, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(0, 1, 1))
DIFFSPEC = SpecConfig.from_flat(dict(num_speculative_tokens=3, draft_context_policy="diffspec",
                                     diffspec_chunk_size=16, diffspec_token_budget=64))


def plan(draft: bool, capacity: int = 512, mesh=None, target: ModelConfig = TARGET) -> Plan:
    return Plan(target=target, draft=DRAFT if draft else None, spec=DIFFSPEC if draft else SpecConfig(),
                sampling=SamplingConfig(), aux_layers=DRAFT.resolve_aux_layers(TARGET) if draft else (),
                capacity=capacity, mesh=mesh, draft_tp=1, drafter=Eagle3Drafter() if draft else None)


def shard_bytes(tree) -> int:
    """Bytes of ``tree`` on device 0 (each array's shard there)."""
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree) for s in x.addressable_shards
               if s.device == jax.devices()[0])


@pytest.mark.parametrize("arch, draft, tp", [("llama", False, 1), ("llama", True, 1), ("llama", True, 2),
                                             ("qwen3_5_moe", False, 1)])
def test_state_bytes_are_the_arrays_init_state_creates(arch, draft, tp):
    """Exact, per part and per device (under a tp-way mesh each device holds half the target's KV heads; a
    hybrid target's cache holds its DeltaNet states beside the K/V)."""
    target = TARGET if arch == "llama" else tiny_config(arch)
    p = plan(draft, mesh=make_mesh(tp) if tp > 1 else None, target=target)
    dtype = jnp.bfloat16
    parts = memory.state_bytes(p, 3, dtype, jnp.float32)
    state = init_state(p, 3, dtype, jnp.float32, 0)
    assert parts["kv"] == shard_bytes(state.target_cache)
    if arch == "llama":
        assert parts["kv"] == TARGET.num_hidden_layers * 2 * 3 * (TARGET.num_key_value_heads // tp) * 512 * \
            TARGET.head_dim * 2
    assert parts["draft"] == (shard_bytes(state.draft_cache) if draft else 0)
    assert sum(parts.values()) == shard_bytes(state)


def test_prefill_token_bytes_formula():
    """Llama-3.1-8B shapes in bfloat16: 108 KiB a token target-only (the MLP's gate/up pair and product beside
    the residual; the allocation that failed in issue 37 was 100 KiB a token), 132 KiB with an EAGLE-3 draft's three aux inputs; the
    tiled reference loop adds its float32 scores; tensor parallelism splits the MLP and the heads."""
    big = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    eagle = DraftConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096)
    assert memory.prefill_token_bytes(big) == 2 * (4096 + 2 * 4096 + 3 * 14336) == 108 * 1024
    assert memory.prefill_token_bytes(big, eagle, 3) == 108 * 1024 + 3 * 2 * 4096
    assert memory.prefill_token_bytes(big, flash=False) > memory.prefill_token_bytes(big)
    assert memory.prefill_token_bytes(big, tp=2) < memory.prefill_token_bytes(big)


@given(batch=st.integers(1, 64), token=st.integers(1, 1 << 18), room=st.integers(-(1 << 30), 1 << 40))
@settings(max_examples=200, deadline=None)
def test_chunk_cap_is_the_widest_power_of_two_within_the_share(batch, token, room):
    w = memory.memory_chunk_cap(batch, token, room)
    assert w >= memory.MIN_PREFILL_CHUNK and w & (w - 1) == 0
    budget = memory.PREFILL_TEMP_SHARE * max(0, room)
    if w > memory.MIN_PREFILL_CHUNK:
        assert batch * w * token <= budget < batch * 2 * w * token
    else:
        assert batch * 2 * w * token > budget


def test_chunk_cap_examples():
    """Llama-3.1-8B shapes on an H200 at JAX's default 75% (about 9 GiB left beside 80 GiB of K/V and 15 GiB of
    weights) and at 95% (37 GiB left): batch 8 narrows to 1024 and 4096 tokens; batch 1 with 100 GiB left keeps a
    64K prompt whole."""
    kib = 1024
    assert memory.memory_chunk_cap(8, 108 * kib, 9 << 30) == 1024
    assert memory.memory_chunk_cap(8, 108 * kib, 37 << 30) == 4096
    assert memory.memory_chunk_cap(1, 108 * kib, 100 << 30) >= 65536


def fake_stats(limit: int, in_use: int = 0) -> dict:
    return {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use}


@pytest.mark.parametrize("draft", [False, True])
def test_plan_memory_narrows_chunks_to_the_room_and_check_refuses_what_does_not_fit(draft):
    p = plan(draft, capacity=2048)
    lengths = [2000] * 4
    params = abstract_params(TARGET, jnp.float32)
    free = memory.plan_memory(p, lengths, None, params, None, jnp.float32, jnp.float32, None)
    assert free.bytes_limit is None and (free.prefill_width, free.prefill_chunks) == (512, 4)  # the CPU default
    assert free.weights_bytes == TARGET.num_parameters * 4
    memory.check_fits(free, max_new_tokens=8)  # no limit known: no check
    state = free.state_bytes
    # room for the state and a quarter of it for one 4 x 256 chunk: narrowed from 512 to 256
    stats = fake_stats(state + 4 * 256 * free.prefill_token_bytes * 5, 1000)
    tight = memory.plan_memory(p, lengths, None, params, None, jnp.float32, jnp.float32, stats)
    assert (tight.prefill_width, tight.prefill_chunks) == (256, 8)
    memory.check_fits(tight, max_new_tokens=8)
    assert tight.need_bytes == state + tight.prefill_temp_bytes <= tight.free_bytes
    # an explicit prefill_chunk is kept, and refused when its temporaries do not fit
    given = memory.plan_memory(p, lengths, 2048, params, None, jnp.float32, jnp.float32, stats)
    assert given.prefill_width == 2048
    with pytest.raises(OutOfMemoryError, match=r"prefill temporaries .* for chunks of 4 x 2048 tokens.*a smaller "
                                               r"prefill_chunk \(the prefill temporaries of at most about \d+ tokens"):
        memory.check_fits(given, max_new_tokens=8)
    # the state alone does not fit: named figures, what to change
    small = memory.plan_memory(p, lengths, None, params, None, jnp.float32, jnp.float32, fake_stats(state, 1 << 10))
    with pytest.raises(OutOfMemoryError) as err:
        memory.check_fits(small, max_new_tokens=8)
    msg = str(err.value)
    for needle in (f"target K/V {memory._size(small.kv_bytes)}", "beside the weights", "1.00 KiB in use",
                   "fewer prompts (batch 4)", "a smaller max_new_tokens (8)", "2048 positions per sequence"):
        assert needle in msg
    assert "prefill_chunk" not in msg  # no chunk fits beside a state that does not
    assert isinstance(err.value, InputError)


def test_device_memory_is_none_without_a_limit(monkeypatch):
    assert memory.device_memory() is None  # CPU
    assert memory.room_for(1 << 60)
    monkeypatch.setattr(memory, "device_memory", lambda device=None: fake_stats(1000, 900))
    assert memory.room_for(100) and not memory.room_for(101)
