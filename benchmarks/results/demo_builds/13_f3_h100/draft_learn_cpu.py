"""Scratch: can our EAGLE-3 draft training teach a draft to copy (follow the target's copy) at all? Short copy-rich
windows on the CPU, then copy_probe's draft agreement on random and natural passages seen 256 tokens earlier."""
import json, sys, time
import numpy as np, jax.numpy as jnp
from transformers import AutoTokenizer
from benchmarks import copy_probe
from diffspec_jax.corpus import build_corpus, encode_documents
from diffspec_jax.draft import DraftModel
from diffspec_jax.target import load_target
from diffspec_jax.train_draft import train_draft
from diffspec_jax.training import OptimConfig, TokenStream

tdir, steps, aux = sys.argv[1], int(sys.argv[2]), tuple(int(x) for x in sys.argv[3].split(","))
target = load_target(tdir, dtype="float32")
tok = AutoTokenizer.from_pretrained(tdir)
corpus = build_corpus(max_files=400)
train = [np.asarray(x, np.int32) for x in tok([d.text for d in corpus.train])["input_ids"]]
stream = TokenStream(train, tok.eos_token_id, recall_fraction=1.0, recall_span=(32, 128), recall_distance=0.1,
                     recall_random=0.5, vocab_size=len(tok), recall_uniform=True, recall_spans=2)
t0 = time.time()
cfg, params, hist = train_draft(target, stream, steps=steps, batch=4, seq_len=512, draft_vocab=2048, aux_layers=aux,
                                optim=OptimConfig(lr=2e-3, warmup_steps=steps // 20, total_steps=steps),
                                compute_dtype=jnp.float32, log_every=max(1, steps // 5), progress=False)
print("trained", time.time() - t0, json.dumps(hist[-1]))
draft = DraftModel(config=cfg, params=params, aux_layers=cfg.aux_layer_ids, own_embedding=False, path="")
doc = max((e.ids for e in encode_documents(tok, corpus.held_out)), key=len)
seqs = copy_probe.copy_sequences(doc, len(tok), 64, 256, 6, seed=0)
for kind in copy_probe.KINDS:
    a = np.stack([np.stack(copy_probe.occurrence_means(copy_probe.draft_agreement(target, draft, q), 64, 256))
                  for q in seqs[kind]])
    print(kind, "first", a[:, 0].mean(0).round(3).tolist(), "second", a[:, 1].mean(0).round(3).tolist())
