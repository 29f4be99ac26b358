"""Scratch (build 14): does an EAGLE-3 draft for the f3 target learn to copy, and which settings help? Trains a draft
from scratch on short windows that each hold two copied passages (``RANDOM`` of them uniform random tokens), then
reports its per-TTT-step agreement with the target on both occurrences of natural and random passages
(``benchmarks/copy_probe.py``'s draft probe, passages of 32 tokens, ``GAP`` tokens apart).

    PYTHONPATH=. python benchmarks/results/demo_builds/14_draft_copy_cpu/draft_copy_cpu.py \\
        TARGET STEPS AUX RANDOM DRAFT_VOCAB LR SEQ_LEN ROPE_THETA GAP
"""
import json
import sys
import time

import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

from benchmarks import copy_probe
from diffspec_jax.corpus import build_corpus, encode_documents
from diffspec_jax.draft import DraftModel
from diffspec_jax.target import load_target
from diffspec_jax.train_draft import train_draft
from diffspec_jax.training import OptimConfig, TokenStream

tdir, steps, aux, rr, vocab, lr, seq, theta, gap = sys.argv[1:10]
steps, aux, rr, vocab, lr = int(steps), tuple(int(x) for x in aux.split(",")), float(rr), int(vocab), float(lr)
seq, theta, gap = int(seq), float(theta), int(gap)
target = load_target(tdir, dtype="float32")
tok = AutoTokenizer.from_pretrained(tdir)
corpus = build_corpus(max_files=400)
train = [np.asarray(x, np.int32) for x in tok([d.text for d in corpus.train])["input_ids"]]
stream = TokenStream(train, tok.eos_token_id, recall_fraction=1.0, recall_span=(16, seq // 4), recall_distance=0.1,
                     recall_random=rr, vocab_size=len(tok), recall_uniform=True, recall_spans=2)
t0 = time.time()
cfg, params, hist = train_draft(target, stream, steps=steps, batch=8, seq_len=seq, draft_vocab=vocab, aux_layers=aux,
                                optim=OptimConfig(lr=lr, warmup_steps=steps // 20, total_steps=steps),
                                compute_dtype=jnp.float32, log_every=max(1, steps // 10), progress=False,
                                rope_theta=theta)
for h in hist:
    print(json.dumps({k: round(v, 3) for k, v in h.items()}), flush=True)
print(f"trained in {time.time() - t0:.0f} s", flush=True)
draft = DraftModel(config=cfg, params=params, aux_layers=cfg.aux_layer_ids, own_embedding=False, path="")
doc = max((e.ids for e in encode_documents(tok, corpus.held_out)), key=len)
seqs = copy_probe.copy_sequences(doc, len(tok), 32, gap, 6, seed=0)
for kind in copy_probe.KINDS:
    a = np.stack([np.stack(copy_probe.occurrence_means(copy_probe.draft_agreement(target, draft, q), 32, gap))
                  for q in seqs[kind]])
    print(kind, "first", a[:, 0].mean(0).round(3).tolist(), "second", a[:, 1].mean(0).round(3).tolist(), flush=True)
