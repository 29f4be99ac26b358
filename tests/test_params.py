"""Parameter tables (diffspec_jax.models.params): what each model's table derives (Hugging Face names and shapes,
params shapes, partition specs, the tensor-parallel layout, random init) against independent expectations:
transformers' own state dicts, the layouts written out literally, NumPy, and the init rules re-implemented here;
and a toy model that is one table and one forward function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints_tools import hf
from checkpoints_tools.make_tiny import _transformers_class, tiny_config, tiny_draft_config, transformers_config
from diffspec_jax import make_mesh, sharding
from diffspec_jax.models import eagle3, family, llama
from diffspec_jax.models import params as tables

COL, ROW, TP = P(None, "tp", None), P("tp", None, None), "tp"
CONFIGS = {"llama": {}, "qwen3": {}, "qwen3_5_moe": {},
           "qwen3_5_wrapper": dict(architecture="Qwen3_5MoeForConditionalGeneration")}


def config_of(name):
    return tiny_config("qwen3_5_moe" if name.startswith("qwen3_5") else name, **CONFIGS[name])


def flat(tree, is_leaf=None) -> dict[tuple, object]:
    return dict(zip(tables.leaf_paths(tree, is_leaf), jax.tree_util.tree_leaves(tree, is_leaf=is_leaf)))


def expected_layer(c, n) -> dict[str, tuple[tuple[int, ...], P]]:
    """Leaf name -> (shape, partition spec) of layer ``n``, as the layouts were written before the tables."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    if c.family == "llama":
        out = {"attn_norm": ((h,), P()), "wq": ((h, hq, d), COL), "wk": ((h, hkv, d), COL), "wv": ((h, hkv, d), COL),
               "wo": ((hq, d, h), ROW), "mlp_norm": ((h,), P()), "w_gate": ((h, i), P(None, TP)),
               "w_up": ((h, i), P(None, TP)), "w_down": ((i, h), P(TP, None))}
        if c.qk_norm:
            out.update(q_norm=((d,), P()), k_norm=((d,), P()))
        return out
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    w, e, s = c.linear_conv_kernel_dim, c.num_experts, c.shared_expert_intermediate_size
    moe = {"mlp_norm": ((h,), P()), "router": ((h, e), P()), "we_gate": ((e, h, i), P(None, None, TP)),
           "we_up": ((e, h, i), P(None, None, TP)), "we_down": ((e, i, h), P(None, TP, None)),
           "ws_gate": ((h, s), P(None, TP)), "ws_up": ((h, s), P(None, TP)), "ws_down": ((s, h), P(TP, None)),
           "shared_gate": ((h, 1), P())}
    if c.layer_type(n) == "full_attention":
        return {"attn_norm": ((h,), P()), "wq": ((h, hq, d), COL), "wg": ((h, hq, d), COL), "wk": ((h, hkv, d), COL),
                "wv": ((h, hkv, d), COL), "q_norm": ((d,), P()), "k_norm": ((d,), P()), "wo": ((hq, d, h), ROW), **moe}
    return {"attn_norm": ((h,), P()), "lin_wq": ((h, hk, dk), COL), "lin_wk": ((h, hk, dk), COL),
            "lin_wv": ((h, hv, dv), COL), "conv_q": ((w, hk, dk), COL), "conv_k": ((w, hk, dk), COL),
            "conv_v": ((w, hv, dv), COL), "lin_wz": ((h, hv, dv), COL), "lin_wb": ((h, hv), P(None, TP)),
            "lin_wa": ((h, hv), P(None, TP)), "dt_bias": ((hv,), P(TP)), "A_log": ((hv,), P(TP)),
            "lin_norm": ((dv,), P()), "lin_wo": ((hv, dv, h), ROW), **moe}


def expected_target(c) -> dict[tuple, tuple[tuple[int, ...], P]]:
    out = {("embed",): ((c.vocab_size, c.hidden_size), P(TP, None)), ("final_norm",): ((c.hidden_size,), P())}
    if not c.tie_word_embeddings:
        out[("lm_head",)] = ((c.hidden_size, c.vocab_size), P(None, TP))
    for n in range(c.num_hidden_layers):
        out.update({("layers", n, k): v for k, v in expected_layer(c, n).items()})
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_target_tables_match_transformers_and_the_old_layouts(name):
    torch = pytest.importorskip("torch")
    c = config_of(name)
    table = family(c).table(c)
    with torch.device("meta"):  # names and shapes only
        model = _transformers_class(c)(transformers_config(c))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not k.startswith("model.visual.") and not (c.tie_word_embeddings and k == "lm_head.weight")}
    ours = {k: tables.hf_shape(rows) for k, rows in tables.hf_tensors(table).items()}
    assert ours == theirs
    want = expected_target(c)
    assert flat(tables.shapes(table), tables.is_shape) == {k: s for k, (s, _) in want.items()}
    assert flat(family(c).param_shapes(c), tables.is_shape) == {k: s for k, (s, _) in want.items()}
    specs = flat(tables.partition_specs(table), lambda x: isinstance(x, P))
    assert specs == {k: spec for k, (_, spec) in want.items()}


def test_hf_names_of_joint_tensors():
    c = config_of("qwen3_5_moe")
    names = tables.hf_names(family(c).table(c))
    full, lin = c.full_attention_layers[0], c.linear_attention_layers[0]
    assert names["layers", full, "wq"] == names["layers", full, "wg"] == f"model.layers.{full}.self_attn.q_proj.weight"
    assert {names["layers", lin, k] for k in ("lin_wq", "lin_wk", "lin_wv")} == {
        f"model.layers.{lin}.linear_attn.in_proj_qkv.weight"}
    assert names["layers", lin, "we_gate"] == f"model.layers.{lin}.mlp.experts.gate_up_proj"
    wrapper = tables.hf_names(family(config_of("qwen3_5_wrapper")).table(config_of("qwen3_5_wrapper")))
    assert wrapper["embed",] == "model.language_model.embed_tokens.weight"


@pytest.mark.parametrize("own", [False, True])
def test_draft_table_matches_the_eagle3_layout(own):
    c = tiny_draft_config(tiny_config("llama"), 128)
    h, i, d, hq, hkv, vd = (c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads,
                            c.num_key_value_heads, c.draft_vocab_size)
    table = eagle3.param_table(c, 3, own_embedding=own)
    names = {"fc.weight": (h, 3 * c.target_hidden_size), "midlayer.hidden_norm.weight": (h,),
             "midlayer.input_layernorm.weight": (h,), "midlayer.self_attn.q_proj.weight": (hq * d, 2 * h),
             "midlayer.self_attn.k_proj.weight": (hkv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (hkv * d, 2 * h),
             "midlayer.self_attn.o_proj.weight": (h, hq * d), "midlayer.post_attention_layernorm.weight": (h,),
             "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
             "midlayer.mlp.down_proj.weight": (h, i), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    if own:
        names["embed_tokens.weight"] = (c.vocab_size, h)
    assert {k: tables.hf_shape(r) for k, r in tables.hf_tensors(table).items()} == names
    assert set(tables.hf_tensors(eagle3.param_table(c, 3, layer_prefix="layers.0."))) == {
        k.replace("midlayer.", "layers.0.") for k in names if k != "embed_tokens.weight"}
    want = {"fc": ((3 * c.target_hidden_size, h), P()), "hidden_norm": ((h,), P()), "input_norm": ((h,), P()),
            "wq": ((2 * h, hq, d), COL), "wk": ((2 * h, hkv, d), COL), "wv": ((2 * h, hkv, d), COL),
            "wo": ((hq, d, h), ROW), "mlp_norm": ((h,), P()), "w_gate": ((h, i), P(None, TP)),
            "w_up": ((h, i), P(None, TP)), "w_down": ((i, h), P(TP, None)), "final_norm": ((h,), P()),
            "lm_head": ((h, vd), P(None, TP)), "d2t": ((vd,), P())}
    if own:
        want["embed"] = ((c.vocab_size, h), P(TP, None))
    assert eagle3.param_shapes(c, 3, own) == {k: s for k, (s, _) in want.items()}
    assert tables.partition_specs(table) == {k: spec for k, (_, spec) in want.items()}


# ------------------------------------------------------------------------------------ init: the old rules
def _old_target_rule(c):
    if c.family == "llama":
        return lambda name, rng, shape, scale: (1.0 + 0.2 * rng.standard_normal(shape) if "norm" in name
                                                else scale * rng.standard_normal(shape))

    def rule(name, rng, shape, scale):  # Qwen3.5: zero-centred norms, decay rates, conv taps
        if "lin_norm" in name:
            return 1.0 + 0.2 * rng.standard_normal(shape)
        if "norm" in name:
            return 0.2 * rng.standard_normal(shape)
        if "A_log" in name:
            return np.log(rng.uniform(0.05, 1.0, shape))
        if "dt_bias" in name:
            return 0.5 * rng.standard_normal(shape)
        if "conv_" in name:
            return 0.3 * rng.standard_normal(shape)
        return scale * rng.standard_normal(shape)

    return rule


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_5_moe"])
def test_random_init_draws_what_it_always_drew(name):
    c = config_of(name)
    rule, rng = _old_target_rule(c), np.random.default_rng(7)
    shapes = tables.build(tuple(tables.Param(k, s, (None,) * len(s)) for k, (s, _) in expected_target(c).items()),
                          lambda p: p.shape)
    want = jax.tree_util.tree_map_with_path(lambda kp, s: rule(jax.tree_util.keystr(kp), rng, s, 0.05), shapes,
                                            is_leaf=tables.is_shape)
    ours = family(c).init_params(c, seed=7, dtype=jnp.float32, scale=0.05)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))


def test_draft_init_draws_in_declaration_order():
    c = tiny_draft_config(tiny_config("llama"), 128)
    rng = np.random.default_rng(3)
    want = {}
    for k, shape in eagle3.param_shapes(c, 3).items():  # the order the draft's init has always drawn in
        if k == "d2t":
            used = np.sort(rng.choice(c.vocab_size, c.draft_vocab_size, replace=False))
            want[k] = (used - np.arange(len(used))).astype(np.int32)
        else:
            want[k] = (1.0 + 0.2 * rng.standard_normal(shape) if "norm" in k else 0.08 * rng.standard_normal(shape))
    ours = eagle3.init_params(c, 3, seed=3)
    assert ours["d2t"].dtype == jnp.int32
    for k in want:
        np.testing.assert_array_equal(np.asarray(ours[k]), want[k].astype(np.asarray(ours[k]).dtype), err_msg=k)


# ------------------------------------------------------------------------------ tensor-parallel layout
def test_tensor_parallel_layout_repeats_pads_and_regroups():
    c = tiny_config("llama", vocab_size=250)  # 250 rows pad to 252 over tp=4; 2 KV heads repeat twice
    params = llama.init_params(c, seed=1)
    out, specs = sharding.shard_layout_target(c, params, 4)
    np.testing.assert_array_equal(out["embed"], np.pad(np.asarray(params["embed"]), ((0, 2), (0, 0))))
    np.testing.assert_array_equal(out["lm_head"], np.pad(np.asarray(params["lm_head"]), ((0, 0), (0, 2))))
    lay = params["layers"][1]
    np.testing.assert_array_equal(out["layers"][1]["wk"], np.repeat(np.asarray(lay["wk"]), 2, axis=1))
    np.testing.assert_array_equal(out["layers"][1]["wq"], lay["wq"])
    assert specs["layers"][1]["wk"] == COL and specs["embed"] == P(TP, None)
    # the fused layout regroups whole KV groups: the same as fusing the repeated heads
    fused, fspecs = sharding.shard_layout_target(c, llama.fuse_projections(c, params), 4)
    np.testing.assert_array_equal(fused["layers"][1]["wqkv"], llama.fuse_layer(out["layers"][1])["wqkv"])
    assert fspecs["layers"][1]["wqkv"] == P(None, TP, None, None)
    assert fspecs["layers"][1]["w_gate_up"] == P(None, None, TP)
    with pytest.raises(ValueError, match="do not match their table"):
        tables.shard(llama.param_table(c), {**params, "extra": params["embed"]}, 4)


# ------------------------------------------------------------------------------- a toy model: one table
def toy_table(vocab: int, hidden: int) -> tables.Table:
    """A bigram model: an embedding and an untied head (a PyTorch Linear on disk), both vocabulary-parallel."""
    return (tables.Param(("embed",), (vocab, hidden), ("vocab", None), "embed.weight"),
            tables.Param(("head",), (hidden, vocab), (None, "vocab"), "head.weight", tables.Linear()))


def toy_forward(params, tokens):
    return params["embed"][tokens] @ params["head"]


def test_a_toy_model_is_one_table_and_one_forward(tmp_path):
    table = toy_table(10, 4)
    params = tables.init(table, seed=2, scale=0.5)
    assert tables.shapes(table) == {"embed": (10, 4), "head": (4, 10)}
    hf.write_safetensors(tmp_path, hf.export_tensors(params, table))
    with hf.WeightReader(tmp_path) as reader:
        on_disk = {k: reader.get(k) for k in reader.keys()}
        loaded = hf.read_tensors(reader, table, jnp.float32)
    assert {k: v.shape for k, v in on_disk.items()} == {"embed.weight": (10, 4), "head.weight": (10, 4)}
    tokens = np.array([[1, 7, 3]])
    ref = on_disk["embed.weight"][tokens] @ on_disk["head.weight"].T  # what torch's Linear computes
    np.testing.assert_allclose(toy_forward(loaded, tokens), ref, rtol=1e-5, atol=1e-6)
    sharded = tables.shard(table, params, 4)
    assert sharded["embed"].shape == (12, 4) and sharded["head"].shape == (4, 12)
    assert tables.partition_specs(table) == {"embed": P(TP, None), "head": P(None, TP)}


def test_a_toy_model_runs_tensor_parallel_from_its_table(tmp_path):
    """The same toy table, loaded from its checkpoint, laid out over tp=4 (vocabulary padded, sharded), placed on a
    mesh and run per shard by the one jit(shard_map) builder: the logits are the single-device ones."""
    table, tp = toy_table(10, 4), 4
    params = tables.init(table, seed=5, scale=0.5)
    hf.write_safetensors(tmp_path, hf.export_tensors(params, table))
    with hf.WeightReader(tmp_path) as reader:
        loaded = hf.read_tensors(reader, table, jnp.float32)
    mesh = make_mesh(tp)
    placed = sharding.put(tables.shard(table, loaded, tp), tables.partition_specs(table), mesh)

    def shard_forward(p, tokens):  # a vocabulary-parallel lookup (masked, psum-ed), local logits
        rows = p["embed"].shape[0]
        local = tokens - jax.lax.axis_index(TP) * rows
        hit = (local >= 0) & (local < rows)
        x = jnp.where(hit[..., None], p["embed"][jnp.clip(local, 0, rows - 1)], 0.0)
        return jax.lax.psum(x, TP) @ p["head"]

    fn = sharding.jit_sharded(shard_forward, mesh, (tables.partition_specs(table), P()), P(None, None, TP))
    tokens = jnp.asarray([[1, 9, 3, 0], [7, 7, 2, 5]], jnp.int32)
    np.testing.assert_allclose(np.asarray(fn(placed, tokens))[..., :10], toy_forward(params, tokens), rtol=1e-6,
                               atol=1e-6)


def test_joint_tensors_round_trip():
    c = config_of("qwen3_5_moe")
    table = family(c).table(c)
    params = family(c).init_params(c, seed=4)
    tensors = hf.export_tensors(params, table)
    for key, rows in tables.hf_tensors(table).items():
        for row, leaf in zip(rows, tables.from_hf(rows, tensors[key])):
            np.testing.assert_array_equal(leaf, np.asarray(tables.get_leaf(params, row.path)), err_msg=key)
    full = c.full_attention_layers[0]
    q_proj = tensors[f"model.layers.{full}.self_attn.q_proj.weight"].reshape(c.num_attention_heads, 2, c.head_dim, -1)
    wq = np.asarray(params["layers"][full]["wq"])  # [H, Hq, D]: head j's query rows come first, then its gate rows
    np.testing.assert_array_equal(q_proj[:, 0], np.moveaxis(wq, 0, -1))


def test_a_row_names_at_most_one_known_axis():
    with pytest.raises(ValueError, match="at most one"):
        tables.Param(("w",), (4, 4), ("heads", "mlp"))
    with pytest.raises(ValueError, match="at most one"):
        tables.Param(("w",), (4,), ("experts",))
    with pytest.raises(ValueError, match="axes"):
        tables.Param(("w",), (4, 4), (None,))
