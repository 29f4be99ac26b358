"""EAGLE-3 draft: config dialects, loading and refusals, and the forward pass against NumPy."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, rewrite_safetensors
from diffspec_jax import DraftConfig, load_draft
from diffspec_jax.cache import KVCache
from diffspec_jax.errors import CheckpointError, ConfigError, UnsupportedModelError
from diffspec_jax.models import eagle3, llama
from diffspec_jax.target import step_fn

BASE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "draft_vocab_size": 128,
        "num_hidden_layers": 1}


# ------------------------------------------------------------------------------------------- NumPy reference
def np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class NumpyDraft:
    """The documented EAGLE-3 equations in float64 NumPy, one entry at a time."""

    def __init__(self, cfg: DraftConfig, params):
        self.c = cfg
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.keys, self.values = [], []

    def entry(self, token, g, pos, from_target):
        p, c = self.p, self.c
        if from_target:
            g = g @ p["fc"]
        z = np.concatenate([np_rms(p["embed"][token], p["input_norm"], c.rms_norm_eps),
                            np_rms(g, p["hidden_norm"], c.rms_norm_eps)])
        q = np.einsum("c,cnd->nd", z, p["wq"])
        k = np.einsum("c,cnd->nd", z, p["wk"])
        v = np.einsum("c,cnd->nd", z, p["wv"])
        k = np_rope(k[None], np.array([pos]), c.rope.theta)[0]
        self.keys.append(k)
        self.values.append(v)
        return np_rope(q[None], np.array([pos]), c.rope.theta)[0], g

    def attend_and_finish(self, q, residual):
        p, c = self.p, self.c
        keys, values = np.stack(self.keys), np.stack(self.values)  # [S, Hkv, D]
        g = q.shape[0] // keys.shape[1]
        out = np.zeros_like(q)
        for h in range(q.shape[0]):
            s = keys[:, h // g] @ q[h] / np.sqrt(c.head_dim)
            w = np.exp(s - s.max())
            out[h] = (w / w.sum()) @ values[:, h // g]
        h_ = residual + np.einsum("nd,ndh->h", out, p["wo"])
        x = np_rms(h_, p["mlp_norm"], c.rms_norm_eps)
        a = x @ p["w_gate"]
        h2 = h_ + ((a / (1 + np.exp(-a))) * (x @ p["w_up"])) @ p["w_down"]
        logits = np_rms(h2, p["final_norm"], c.rms_norm_eps) @ p["lm_head"]
        return h2, logits


def target_aux(target, draft, prompt):
    cache = KVCache.create(target.config, 1, 256, jnp.float32)
    ids = jnp.asarray([prompt], jnp.int32)
    out, _ = step_fn(target.config, target.params, cache, ids, jnp.zeros(1, jnp.int32),
                     jnp.asarray([[len(prompt) - 1]], jnp.int32), aux_layers=draft.aux_layers)
    return np.asarray(out.aux[0], np.float64), np.asarray(out.logits[0, 0])


def test_aux_states_are_hf_hidden_states_at_the_same_indices(targets, drafts, hf_models):
    """EAGLE-3's aux index convention: our aux i equals transformers' output_hidden_states[i]."""
    import torch

    prompt = random_prompts(0, [40])[0]
    aux, _ = target_aux(targets["llama"], drafts["llama"], prompt)
    with torch.no_grad():
        hs = hf_models["llama"](torch.tensor([prompt]), output_hidden_states=True).hidden_states
    h = targets["llama"].config.hidden_size
    assert drafts["llama"].aux_layers == (0, 2, 3)
    for j, layer in enumerate(drafts["llama"].aux_layers):
        np.testing.assert_allclose(aux[:, j * h:(j + 1) * h], hs[layer][0].numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_draft_forward_matches_numpy(arch, targets, drafts):
    draft = drafts[arch]
    prompt = random_prompts(1, [24])[0]
    aux, _ = target_aux(targets[arch], draft, prompt)
    tokens = prompt[1:] + [7]
    h2, logits = eagle3.forward(draft.config, draft.params, jnp.asarray([tokens]), jnp.asarray(aux[None],
                                                                                              jnp.float32))
    ref = NumpyDraft(draft.config, draft.params)
    for t in range(len(tokens)):
        q, g = ref.entry(tokens[t], aux[t], t, from_target=True)
        rh2, rlogits = ref.attend_and_finish(q, g)
        np.testing.assert_allclose(np.asarray(h2[0, t]), rh2, atol=5e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(logits[0, t]), rlogits, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_chain_drafts_match_numpy_chain(arch, targets, drafts):
    """Draft prefill + step 0 + chain inside the engine propose what the NumPy chain (fc only on target
    features, pre-norm h2 fed back, positions r + j, d2t mapping) proposes."""
    from diffspec_jax import SamplingConfig, SpecConfig, engine
    from diffspec_jax.engine.propose import Eagle3Drafter

    target, draft = targets[arch], drafts[arch]
    prompt = random_prompts(2, [30])[0]
    k = 4
    plan = engine.Plan(target=target.config, draft=draft.config, spec=SpecConfig(num_speculative_tokens=k),
                       sampling=SamplingConfig(), aux_layers=draft.aux_layers, capacity=256,
                       drafter=Eagle3Drafter())
    state = engine.init_state(plan, 1, jnp.float32, jnp.float32, 0)
    acc = engine._PrefillAcc(logits=jnp.zeros((1, 256)), aux=jnp.zeros((1, 3 * 64)),
                             score_q=jnp.zeros((1, 4, target.config.head_dim)), score_lse=jnp.zeros((1, 4)))
    toks = np.zeros((1, 65), np.int32)
    toks[0, :30] = prompt
    fns = engine.compiled(plan)
    state, acc = fns.prefill_chunk(target.params, draft.params, state, acc, jnp.asarray(toks[:, :64]),
                                   jnp.asarray(toks[:, 1:65]), jnp.zeros(1, jnp.int32), jnp.asarray([30]))
    state, first = fns.start_decode(state, acc, jnp.asarray([30]))
    drafts_, _, _, _, n, _ = engine.draft_propose(plan, draft.params, state, jnp.asarray([True]),
                                                  jnp.zeros(2, jnp.uint32))
    aux, logits = target_aux(target, draft, prompt)
    x_p = int(np.argmax(logits))
    assert int(first[0]) == x_p and int(n[0]) == 29
    ref = NumpyDraft(draft.config, draft.params)
    tokens = prompt[1:] + [x_p]
    for t in range(30):
        q, g = ref.entry(tokens[t], aux[t], t, from_target=True)
    d2t = np.asarray(draft.params["d2t"])
    h2, lg = ref.attend_and_finish(q, g)
    expected = []
    for j in range(k):
        d = int(np.argmax(lg))
        expected.append(d + int(d2t[d]))
        q, g = ref.entry(expected[-1], h2, 29 + 1 + j, from_target=False)
        h2, lg = ref.attend_and_finish(q, g)
    assert list(np.asarray(drafts_[0])) == expected


# --------------------------------------------------------------------------------------- config and loading
def test_aux_id_conventions():
    hf = DraftConfig.from_dict({**BASE, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]})
    assert hf.aux_layer_ids == (2, 16, 29)
    specforge = DraftConfig.from_dict({**BASE, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}})
    assert specforge.aux_layer_ids == (2, 16, 29)  # first id 1 = output-of-layer ids: +1
    forced = DraftConfig.from_dict({**BASE, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}, aux_convention="hf")
    assert forced.aux_layer_ids == (1, 15, 28)
    out = DraftConfig.from_dict({**BASE, "eagle_aux_hidden_state_layer_ids": [3, 15, 28]}, aux_convention="output")
    assert out.aux_layer_ids == (4, 16, 29)
    d = DraftConfig.from_dict(BASE)
    assert d.rope.theta == 10000.0 and d.aux_layer_ids is None and d.target_hidden_size == 64
    assert DraftConfig.from_dict({k: v for k, v in BASE.items() if k != "draft_vocab_size"}).draft_vocab_size == 256


@pytest.fixture
def draft_copy(tmp_path, draft_dirs):
    dst = tmp_path / "draft"
    shutil.copytree(draft_dirs["llama"], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_vocabulary_mismatch(draft_copy, targets):
    _edit_config(draft_copy, vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary mismatch: the draft's vocab_size is 300, the target's is 256"):
        load_draft(draft_copy, targets["llama"])


def test_aux_ids_out_of_range(draft_copy, targets):
    _edit_config(draft_copy, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 3, 4]})
    with pytest.raises(ConfigError, match=r"aux layer ids \[2, 3, 4\].*out of range for a target with 4 layers"):
        load_draft(draft_copy, targets["llama"])
    with pytest.raises(ConfigError, match="out of range"):
        load_draft(draft_copy, targets["llama"], aux_convention="hf", aux_layer_ids=(0, 1, 9))


def test_fc_width_not_matching_target_hidden(draft_copy, targets):
    _edit_config(draft_copy, target_hidden_size=48)
    with pytest.raises(ConfigError, match="fc expects aux states of width 48, the target's hidden size is 64"):
        load_draft(draft_copy, targets["llama"])


def test_fc_tensor_not_a_multiple_of_target_hidden(draft_copy, targets):
    rewrite_safetensors(draft_copy, lambda t: t.update({"fc.weight": np.zeros((64, 100), np.float32)}))
    with pytest.raises(ConfigError, match="fc.weight has input width 100, not a multiple"):
        load_draft(draft_copy, targets["llama"])


def test_more_than_one_draft_layer(draft_copy, targets):
    _edit_config(draft_copy, num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match="exactly one layer, this one has 2"):
        load_draft(draft_copy, targets["llama"])


def test_inconsistent_d2t_t2d(draft_copy, targets):
    rewrite_safetensors(draft_copy, lambda t: t.update({"t2d": np.roll(t["t2d"], 1)}))
    with pytest.raises(CheckpointError, match="t2d and d2t disagree"):
        load_draft(draft_copy, targets["llama"])


def test_equal_vocab_draft_has_no_d2t_and_shares_the_embedding(draft_dirs, drafts, targets):
    from safetensors import safe_open

    with safe_open(str(draft_dirs["qwen3"] / "model.safetensors"), "numpy") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
        assert not any("embed" in k for k in f.keys())
    d = drafts["qwen3"]
    assert not np.any(np.asarray(d.params["d2t"]))
    assert d.params["embed"] is targets["qwen3"].params["embed"] or np.array_equal(
        d.params["embed"], targets["qwen3"].params["embed"])
    assert d.aux_layers == (2, 2, 1)  # (2, L // 2, L - 3) for the 4-layer target


def test_layers_0_prefix_is_accepted(draft_copy, targets, drafts):
    def rename(t):
        for k in [k for k in t if k.startswith("midlayer.")]:
            t[k.replace("midlayer.", "layers.0.")] = t.pop(k)

    rewrite_safetensors(draft_copy, rename)
    d = load_draft(draft_copy, targets["llama"])
    np.testing.assert_array_equal(d.params["wq"], drafts["llama"].params["wq"])


def test_param_layout_is_documented_shapes(drafts):
    d = drafts["llama"]
    shapes = eagle3.param_shapes(d.config)
    for name, shape in shapes.items():
        assert tuple(d.params[name].shape) == shape, name
    assert d.params["d2t"].dtype == jnp.int32
    assert llama  # target layout module is importable alongside
