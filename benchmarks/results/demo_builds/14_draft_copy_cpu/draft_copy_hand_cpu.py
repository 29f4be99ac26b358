"""Scratch (build 14): can a one-layer EAGLE-3 draft for the f3 target represent copying at all? Weights set by hand,
no training: ``fc`` passes the first aux state (index AUX0) through; four key/value heads match the entry's token
(query side) against that state (key side) in the 12 slowest-turning RoPE dimensions of each head, and carry the
matched entry's token to an LM head made of the target's normalised embeddings. Prints the draft probe as
``draft_copy_cpu.py`` does (passages of 32 tokens, GAP apart).

    PYTHONPATH=. python benchmarks/results/demo_builds/14_draft_copy_cpu/draft_copy_hand_cpu.py QK_GAIN V_GAIN GAP AUX0 ROPE_THETA
"""
import sys

import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer
from benchmarks import copy_probe
from diffspec_jax.corpus import build_corpus, encode_documents
from diffspec_jax.draft import DraftModel
from diffspec_jax.target import load_target
from diffspec_jax.train_draft import draft_config_for
from diffspec_jax.models import eagle3
T = "benchmarks/results/demo_builds/13_f3_h100/f3/target"
c2, vs, gap = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
A0, TH = int(sys.argv[4]), float(sys.argv[5])
target = load_target(T, dtype="float32"); tok = AutoTokenizer.from_pretrained(T)
V = target.config.vocab_size; H = target.config.hidden_size
used = np.arange(V)
cfg = draft_config_for(target, V, (A0, 3, 5), TH)
p = {k: np.array(v) for k, v in eagle3.init_params(cfg, 3, seed=0, used_ids=used).items()}
E = np.asarray(target.params["embed"], np.float32)
rng = np.random.default_rng(0)
Q, _ = np.linalg.qr(rng.standard_normal((H, H)))
D = cfg.head_dim; low = list(range(10, 16)) + list(range(26, 32))
p["fc"][:] = 0; p["fc"][:H] = np.eye(H)
for k in ("hidden_norm", "input_norm", "mlp_norm", "final_norm"): p[k][:] = 1
p["wq"][:] = 0; p["wk"][:] = 0; p["wv"][:] = 0; p["wo"][:] = 0; p["w_down"][:] = 0
for k in range(cfg.num_key_value_heads):
    P = Q[:, 12 * k:12 * k + 12]
    p["wk"][H:, k][:, low] = np.sqrt(c2) * P
    Pv = Q[:, 32 * k:32 * k + 32]
    p["wv"][:H, k] = Pv
    for i in range(2):
        h = 2 * k + i
        p["wq"][:H, h][:, low] = np.sqrt(c2) * P
        p["wo"][h] = vs * Pv.T / 2
En = E / np.sqrt(np.mean(E ** 2, axis=1, keepdims=True))
p["lm_head"] = (En.T / H).astype(np.float32)
p["embed"] = target.params["embed"]
params = {k: jnp.asarray(v) for k, v in p.items()}
draft = DraftModel(config=cfg, params=params, aux_layers=cfg.aux_layer_ids, own_embedding=False, path="")
corpus = build_corpus(max_files=50)
doc = max((e.ids for e in encode_documents(tok, corpus.held_out)), key=len)
seqs = copy_probe.copy_sequences(doc, V, 32, gap, 4, seed=0)
for kind in copy_probe.KINDS:
    a = np.stack([np.stack(copy_probe.occurrence_means(copy_probe.draft_agreement(target, draft, q), 32, gap))
                  for q in seqs[kind]])
    print(kind, "first", a[:, 0].mean(0).round(3).tolist(), "second", a[:, 1].mean(0).round(3).tolist(), flush=True)
