"""EAGLE-3 draft training in JAX (optax + Orbax): ``python -m diffspec_jax.train_draft``.

Trains a one-layer EAGLE-3 draft for any supported target from text or JSONL files:

* the target is frozen; each window of ``seq_len + K`` tokens goes through it once for the aux states of the
  configured layers (HF ``hidden_states`` indices) and its logits;
* the draft vocabulary is the ``draft_vocab`` most frequent target ids of the training data (``d2t``/``t2d``);
* **training-time test** (TTT) unrolls K >= 3 draft steps: step 0 feeds ``(x_{t+1}, F_t)`` at position t (``fc``
  on target features); step k feeds ``(x_{t+1+k}, h2_{k-1}(t))`` at position ``t + k``, attending to the step-0
  keys at positions <= t and to the same entry's keys of steps 1..k -- exactly what chain step k of the engine
  sees from a root at t. Step k is trained towards the target's distribution of token ``x_{t+2+k}`` restricted to
  the draft vocabulary (cross-entropy, mean over steps);
* periodic evaluation on held-out windows reports each step's top-1 agreement with the target and the expected
  chain acceptance length (teacher-forced);
* Orbax checkpoints of the training state (resumable) and export in the SpecForge / vLLM EAGLE-3 layout, which
  :func:`diffspec_jax.load_draft` reads back.

Example::

    python -m diffspec_jax.train_draft --target path/to/target --data a.txt b.jsonl --out path/to/draft \\
        --steps 2000 --seq-len 2048 --batch 8 --ttt-steps 4 --draft-vocab 2048

``--out`` is written safely (:class:`diffspec_jax.outdir.OutputDir`): into ``OUT.partial`` first (the training
checkpoints too, by default in ``OUT.partial/checkpoints``: an interrupted run leaves it, and the same command
continues from it), renamed into place at the end with a ``diffspec_manifest.json`` of SHA-256 digests that
``load_draft`` verifies. A non-empty ``--out`` is refused unless an earlier diffspec tool wrote it or
``--overwrite`` is given (the old contents are then moved to ``OUT.replaced-<time>``, never deleted); an
explicit ``--ckpt-dir`` is used in place and may not lie inside ``--out``. Exit status: 0 = trained, 2 = usage
error, 1 = other error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_tools.hf import check_dir, save_eagle3
from diffspec_jax.config import DraftConfig, RopeConfig
from diffspec_jax.errors import ConfigError, DiffspecError, InputError
from diffspec_jax.models import eagle3, family
from diffspec_jax.models import params as tables
from diffspec_jax.outdir import OutputDir
from diffspec_jax.target import TargetModel, load_target
from diffspec_jax.training import OptimConfig, TokenStream, cast_floats, check_resume, train_loop
from diffspec_jax.validation import ArgumentParser, check_choice, check_int, check_real, read_text, report_error

TOOL = "diffspec_jax.train_draft"
ATTENTION = ("dense", "flash")

FROZEN_KEYS = ("embed", "d2t")
#: the draft's RoPE base unless one is given (RopeConfig's default, which a draft config without one also means)
DEFAULT_ROPE_THETA = RopeConfig().theta


def draft_config_for(target: TargetModel, draft_vocab: int, aux_layers: tuple[int, ...],
                     rope_theta: float = DEFAULT_ROPE_THETA) -> DraftConfig:
    """A draft shaped like one target layer (hidden size, heads, head_dim, intermediate size)."""
    tc = target.config
    return DraftConfig(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                       num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                       intermediate_size=tc.intermediate_size, vocab_size=tc.vocab_size,
                       draft_vocab_size=draft_vocab, target_hidden_size=tc.hidden_size, rms_norm_eps=tc.rms_norm_eps,
                       max_position_embeddings=4096, rope=RopeConfig(theta=rope_theta),
                       aux_layer_ids=tuple(aux_layers))


def draft_vocabulary(tokens: np.ndarray, vocab_size: int, draft_vocab: int) -> np.ndarray:
    """The ``draft_vocab`` most frequent ids of ``tokens`` (ties: lower id first), sorted ascending."""
    check_int(draft_vocab, "draft_vocab", min=1, max=vocab_size,
              hint=f" (the draft's output vocabulary, at most the target's {vocab_size})")
    counts = np.bincount(tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:draft_vocab])


def _ttt_attention(q, k0, v0, extra, scale):
    """Step-k attention: causal over step-0 keys, plus the same entry's keys of steps 1..k (float32 softmax).

    q: ``[B, T, Hq, D]``; k0, v0: ``[B, T, Hkv, D]``; extra: list of ``(k_j, v_j)`` ``[B, T, Hkv, D]``.
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s0, -jnp.inf)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, kj, preferred_element_type=jnp.float32) * scale for kj, _ in extra]
    m = jnp.max(s0, axis=-1)
    for sj in diag:
        m = jnp.maximum(m, sj)
    p0 = jnp.exp(s0 - m[..., None])
    pj = [jnp.exp(sj - m) for sj in diag]
    den = jnp.sum(p0, axis=-1) + sum(pj) if pj else jnp.sum(p0, axis=-1)
    out = jnp.einsum("bkgts,bskd->bkgtd", p0.astype(v0.dtype), v0, preferred_element_type=jnp.float32)
    for p, (_, vj) in zip(pj, extra):
        out = out + p[..., None] * jnp.transpose(vj, (0, 2, 1, 3))[:, :, None].astype(jnp.float32)
    out = out / den[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, hq, d).astype(q.dtype)


def ttt_logits(cfg: DraftConfig, p: dict, aux: jax.Array, tokens: jax.Array, steps: int) -> list[jax.Array]:
    """Draft logits ``[B, T, Vd]`` of every TTT step.

    Args:
        aux: ``[B, T, A*Ht]`` target features F_0..F_{T-1}; tokens: int32 ``[B, T + steps]`` with
            ``tokens[:, i] = x_{i+1}`` (step k's entry t takes ``tokens[:, t + k]``).
    """
    b, t = aux.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    scale = cfg.head_dim ** -0.5
    z, residual = eagle3.entry_inputs(cfg, p, tokens[:, :t], aux, from_target=True)
    q, k, v = eagle3.qkv(p, z)
    k0, v0 = eagle3.rope(cfg, k, pos), v
    h2, logits = eagle3.finish(cfg, p, residual, _ttt_attention(eagle3.rope(cfg, q, pos), k0, v0, [], scale))
    out, extra = [logits], []
    for s in range(1, steps):
        z, residual = eagle3.entry_inputs(cfg, p, tokens[:, s:s + t], h2, from_target=False)
        q, k, v = eagle3.qkv(p, z)
        extra.append((eagle3.rope(cfg, k, pos + s), v))
        attn = _ttt_attention(eagle3.rope(cfg, q, pos + s), k0, v0, extra, scale)
        h2, logits = eagle3.finish(cfg, p, residual, attn)
        out.append(logits)
    return out


def _target_pass(tcfg, tparams, window, aux_layers, attention):
    logits, aux = family(tcfg).forward_aux(tcfg, tparams, window, aux_layers=aux_layers, attention=attention)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux)


def ttt_loss(cfg: DraftConfig, tcfg, aux_layers, steps: int, attention: str, compute_dtype,
             trainable: dict, frozen: dict, window: jax.Array):
    """Mean over TTT steps of the cross-entropy to the target's draft-vocabulary distribution.

    ``window``: int32 ``[B, T + steps]`` tokens x_0..x_{T+steps-1}; ``frozen`` = {"target": params, "embed",
    "d2t", "used": int32 [Vd] target ids of the draft vocabulary}.
    """
    t = window.shape[1] - steps
    logits_t, aux = _target_pass(tcfg, frozen["target"], window, aux_layers, attention)
    restricted = jax.nn.softmax(jnp.take(logits_t, frozen["used"], axis=-1), axis=-1)  # [B, T+steps, Vd]
    params = cast_floats({**trainable, "embed": frozen["embed"], "d2t": frozen["d2t"]}, compute_dtype)
    draft_logits = ttt_logits(cfg, params, aux[:, :t].astype(compute_dtype), window[:, 1:], steps)
    losses, agree = [], []
    target_top = jnp.argmax(logits_t, axis=-1)
    for s, lg in enumerate(draft_logits):
        target = restricted[:, 1 + s:1 + s + t]
        losses.append(-jnp.mean(jnp.sum(target * jax.nn.log_softmax(lg, axis=-1), axis=-1)))
        guess = frozen["used"][jnp.argmax(lg, axis=-1)]
        agree.append(guess == target_top[:, 1 + s:1 + s + t])
    run = jnp.cumprod(jnp.stack(agree, axis=-1).astype(jnp.float32), axis=-1)
    metrics = {f"top1_step{s}": jnp.mean(a) for s, a in enumerate(agree)}
    metrics["acceptance_length"] = 1.0 + jnp.mean(jnp.sum(run, axis=-1))  # teacher-forced chain estimate
    return jnp.mean(jnp.stack(losses)), metrics


def train_draft(target: TargetModel, stream: TokenStream, *, steps: int, batch: int, seq_len: int,
                ttt_steps: int = 4, draft_vocab: int | None = None, aux_layers: tuple[int, ...] | None = None,
                optim: OptimConfig | None = None, ckpt_dir: str | Path | None = None, seed: int = 0,
                attention: str = "dense", compute_dtype=jnp.bfloat16, eval_stream: TokenStream | None = None,
                eval_every: int = 0, log_every: int = 20, progress: bool = True,
                rope_theta: float = DEFAULT_ROPE_THETA
                ) -> tuple[DraftConfig, dict, list[dict]]:
    """Train an EAGLE-3 draft for ``target``; returns ``(config, params incl. d2t and shared embed, history)``.

    Raises:
        ConfigError: a setting of the wrong type or out of range (each is checked before any work), aux layers the
            target does not have.
    """
    check_train_args(target, stream, steps=steps, batch=batch, seq_len=seq_len, ttt_steps=ttt_steps,
                     draft_vocab=draft_vocab, aux_layers=aux_layers, seed=seed, attention=attention,
                     eval_stream=eval_stream, eval_every=eval_every, log_every=log_every)
    tc = target.config
    cfg, used = plan_draft(target, stream, draft_vocab, aux_layers, rope_theta)
    aux = cfg.aux_layer_ids
    if ckpt_dir is not None:
        check_checkpoints(ckpt_dir, target, cfg, used, steps)
        record = Path(ckpt_dir) / RUN_RECORD
        if not record.exists():
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(run_record(target, cfg, used), indent=1) + "\n")
    params = eagle3.init_params(cfg, num_aux=len(aux), seed=seed, dtype=jnp.float32,
                                scale=1.0 / np.sqrt(cfg.hidden_size), used_ids=used)
    params = {k: (jnp.ones_like(v) if v.ndim == 1 and k != "d2t" else v) for k, v in params.items()}
    frozen = {"target": cast_floats(target.params, compute_dtype), "embed": target.params["embed"],
              "d2t": params["d2t"], "used": jnp.asarray(used, jnp.int32)}
    trainable = {k: v for k, v in params.items() if k not in FROZEN_KEYS}
    loss_fn = lambda tr, fr, win: ttt_loss(cfg, tc, aux, ttt_steps, attention, compute_dtype, tr, fr, win)  # noqa
    eval_fn = None
    if eval_stream is not None and eval_every:
        held = jnp.asarray(eval_stream.batch(0, batch, seq_len + ttt_steps, seed=seed + 1))
        evaluate = jax.jit(lambda tr, fr: loss_fn(tr, fr, held))

        def eval_fn(tr):
            loss, metrics = evaluate(tr, frozen)
            return {"eval_loss": float(loss), **{f"eval_{k}": float(v) for k, v in metrics.items()}}
    trainable, history = train_loop(loss_fn, trainable, stream, steps=steps, batch=batch,
                                    length=seq_len + ttt_steps, optim=optim or OptimConfig(lr=1e-3,
                                                                                            total_steps=steps),
                                    frozen=frozen, ckpt_dir=ckpt_dir, seed=seed, eval_fn=eval_fn,
                                    eval_every=eval_every, log_every=log_every, progress=progress)
    return cfg, {**trainable, "d2t": params["d2t"], "embed": target.params["embed"]}, history


def plan_draft(target: TargetModel, stream: TokenStream, draft_vocab: int | None,
               aux_layers: tuple[int, ...] | None, rope_theta: float = DEFAULT_ROPE_THETA
               ) -> tuple[DraftConfig, np.ndarray]:
    """The draft's config and vocabulary (target ids, ascending) for this target and data (``rope_theta``: the
    draft's own RoPE base; a larger one keeps content matches over long distances in its attention)."""
    tc = target.config
    n = tc.num_hidden_layers
    aux = tuple(int(a) for a in aux_layers) if aux_layers is not None else (2, n // 2, n - 3)
    used = draft_vocabulary(stream.tokens, tc.vocab_size, draft_vocab or tc.vocab_size)
    cfg = draft_config_for(target, len(used), aux, rope_theta)
    cfg.resolve_aux_layers(tc)
    return cfg, used


#: the settings of the run whose checkpoints a checkpoint directory holds (JSON, beside the Orbax steps)
RUN_RECORD = "diffspec_train_draft.json"
#: what each entry of the record is on the command line (named when a resumed run differs)
RECORD_NAMES = {"target": "the target's shape (--target)", "draft_vocab": "the draft vocabulary size (--draft-vocab)",
                "draft_vocab_ids_sha256": "the draft vocabulary's ids differ (they are the most frequent ids of "
                                          "--data: the training data changed)",
                "aux_layers": "the target layers read (--aux-layers)",
                "rope_theta": "the draft's RoPE base (--rope-theta)"}
#: what a record written before an entry existed meant by it
RECORD_DEFAULTS = {"rope_theta": DEFAULT_ROPE_THETA}


def run_record(target: TargetModel, cfg: DraftConfig, used: np.ndarray) -> dict:
    """What a checkpoint of this run depends on: a run that differs in any of it cannot continue from it."""
    tc = target.config
    return {"tool": TOOL, "target": {"hidden_size": tc.hidden_size, "num_hidden_layers": tc.num_hidden_layers,
                                     "vocab_size": tc.vocab_size},
            "draft_vocab": int(len(used)),
            "draft_vocab_ids_sha256": hashlib.sha256(np.asarray(used, np.int64).tobytes()).hexdigest(),
            "aux_layers": [int(a) for a in cfg.aux_layer_ids], "rope_theta": float(cfg.rope.theta)}


def check_checkpoints(ckpt_dir: str | Path, target: TargetModel, cfg: DraftConfig, used: np.ndarray,
                      steps: int) -> int | None:
    """Whether this run can write to and continue from ``ckpt_dir`` (reads only, so the CLI runs it before writing
    anything); returns the step it resumes from (``None``: a fresh start).

    Raises:
        ConfigError: ``ckpt_dir`` holds foreign step folders, checkpoints of a run with other settings (each
            difference named), or more than ``steps`` steps.
    """
    if not Path(ckpt_dir).is_dir():
        return check_resume(ckpt_dir, {}, steps)  # absent: a fresh start; a file: refused
    file = Path(ckpt_dir) / RUN_RECORD
    if file.exists():
        try:
            old = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{file} is unreadable ({exc}); it describes the checkpoints beside it: choose another "
                              f"--ckpt-dir") from None
        new = run_record(target, cfg, used)
        if isinstance(old, dict):
            old = {**RECORD_DEFAULTS, **old}
        differ = [k for k in new if isinstance(old, dict) and old.get(k) != new[k]]
        if "draft_vocab" in differ:  # then the ids differ too
            differ.remove("draft_vocab_ids_sha256")
        diffs = [RECORD_NAMES[k] if k == "draft_vocab_ids_sha256" else
                 f"{RECORD_NAMES.get(k, k)}: {old.get(k)} there, {new[k]} here" for k in differ]
        if not isinstance(old, dict) or old.get("tool") != TOOL:
            diffs = [f"{file} was not written by {TOOL}"]
        if diffs:
            raise ConfigError(f"--ckpt-dir {ckpt_dir} holds checkpoints of another training run ({'; '.join(diffs)}); "
                              f"choose another --ckpt-dir, or that run's settings to continue it")
    trained = {k: v for k, v in tables.shapes(eagle3.param_table(cfg, len(cfg.aux_layer_ids))).items()
               if k not in FROZEN_KEYS}
    return check_resume(ckpt_dir, trained, steps,
                        hint=" (another --draft-vocab, --aux-layers or target than the run that wrote it?)")


def check_train_args(target: TargetModel, stream: TokenStream, *, steps, batch, seq_len, ttt_steps, draft_vocab,
                     aux_layers, seed, attention, eval_stream=None, eval_every=0, log_every=20) -> None:
    """Type and range checks of :func:`train_draft`'s arguments (a :class:`ConfigError` naming the first bad one)."""
    if not isinstance(target, TargetModel):
        raise ConfigError(f"target must be a TargetModel (from load_target), got {type(target).__name__}")
    for name, value in (("stream", stream), ("eval_stream", eval_stream)):
        if value is not None and not isinstance(value, TokenStream):
            raise ConfigError(f"{name} must be a TokenStream, got {type(value).__name__}")
    check_int(steps, "steps", min=1)
    check_int(batch, "batch", min=1, hint=" (windows per training step)")
    check_int(seq_len, "seq_len", min=1, hint=" (tokens per training window)")
    check_int(ttt_steps, "ttt_steps", min=1, hint=" (draft steps unrolled in training-time test)")
    check_int(draft_vocab, "draft_vocab", min=1, max=target.config.vocab_size, none_ok=True)
    check_int(seed, "seed", min=0)
    check_int(eval_every, "eval_every", min=0)
    check_int(log_every, "log_every", min=1)
    check_choice(attention, "attention", ATTENTION)
    if aux_layers is not None:
        if isinstance(aux_layers, (str, bytes)) or not hasattr(aux_layers, "__iter__"):
            raise ConfigError(f"aux_layers must be a sequence of target layer indices, got {aux_layers!r}")
        n = target.config.num_hidden_layers
        for a in aux_layers:
            check_int(a, "aux_layers entry", min=0, max=n - 1, hint=f" (the target has {n} layers)")


def export_draft(out: str | Path, cfg: DraftConfig, params: dict, *, dtype: str = "bfloat16",
                 history: list[dict] | None = None) -> Path:
    """Write the draft in the SpecForge / vLLM EAGLE-3 layout (+ ``training_history.json``)."""
    out = Path(out)
    save_eagle3(out, cfg, params, num_aux=len(cfg.aux_layer_ids), dtype=dtype)
    if history is not None:
        (out / "training_history.json").write_text(json.dumps(history, indent=1) + "\n")
    return out


def read_texts(paths: list[str], field: str = "text") -> list[str]:
    """Documents from text files (one document per file) and JSONL files (one per line, ``field`` key)."""
    texts = []
    for p in map(Path, paths):
        text = read_text(p, "data file")
        if p.suffix == ".jsonl":
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    try:
                        row = json.loads(line)
                        texts.append(str(row[field]))
                    except (json.JSONDecodeError, KeyError, TypeError, IndexError) as exc:
                        raise InputError(f"{p}:{i + 1}: not a JSON object with a {field!r} field "
                                         f"({type(exc).__name__}: {exc})") from None
        else:
            texts.append(text)
    if not texts:
        raise InputError("no training text found")
    return texts


def aux_layers_arg(text: str) -> tuple[int, ...]:
    """The argparse type of an aux-layers option: ``"0,3,5"`` -> (0, 3, 5), layer indices >= 0."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"wants comma-separated layer indices >= 0 such as 0,2,3, got {text!r}")
    return ids


def build_parser() -> ArgumentParser:
    """The CLI's parser (usage errors: one line, exit status 2)."""
    ap = ArgumentParser(prog="python -m diffspec_jax.train_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target directory (HF or Orbax) with a tokenizer")
    ap.add_argument("--data", nargs="+", required=True, help="text files and/or JSONL files")
    ap.add_argument("--eval-data", nargs="*", default=None)
    ap.add_argument("--jsonl-field", default="text")
    ap.add_argument("--out", required=True, help="export directory (EAGLE-3 layout); written to OUT.partial first")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out that no diffspec tool wrote (its contents are moved to "
                         "OUT.replaced-<time>, nothing is deleted)")
    ap.add_argument("--ckpt-dir", default=None,
                    help="Orbax checkpoints (resumable; default OUT.partial/checkpoints, moved to OUT/checkpoints)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--aux-layers", type=aux_layers_arg, default=None, help="comma-separated HF hidden_states indices")
    ap.add_argument("--rope-theta", type=float, default=DEFAULT_ROPE_THETA,
                    help=f"the draft's RoPE base (default {DEFAULT_ROPE_THETA:g})")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--attention", default="flash" if jax.default_backend() == "gpu" else "dense", choices=ATTENTION)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_cli_args(args) -> None:
    """The CLI's numeric options, checked before anything is loaded or written."""
    check_int(args.steps, "--steps", min=1)
    check_int(args.batch, "--batch", min=1, hint=" (windows per training step)")
    check_int(args.seq_len, "--seq-len", min=1, hint=" (tokens per training window)")
    check_int(args.ttt_steps, "--ttt-steps", min=1)
    check_int(args.draft_vocab, "--draft-vocab", min=1, none_ok=True)
    check_real(args.lr, "--lr", min=0.0, min_open=True)
    check_real(args.rope_theta, "--rope-theta", min=0.0, min_open=True)
    check_int(args.warmup, "--warmup", min=0)
    check_int(args.eval_every, "--eval-every", min=0)
    check_int(args.seed, "--seed", min=0)
    if not args.jsonl_field:
        raise ConfigError("--jsonl-field must name a field of the JSONL rows, got ''")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from transformers import AutoTokenizer

        check_cli_args(args)
        check_dir(args.target)
        inputs = [args.target, *args.data, *(args.eval_data or []), args.ckpt_dir]
        out = OutputDir(args.out, tool=TOOL, inputs=inputs, overwrite=args.overwrite, resume=True)
        out.check()  # refusals first, before anything is loaded or written
        texts = read_texts(args.data, args.jsonl_field)
        eval_texts = read_texts(args.eval_data, args.jsonl_field) if args.eval_data else None
        target = load_target(args.target, dtype="float32")
        try:
            tok = AutoTokenizer.from_pretrained(args.target)
        except Exception as exc:  # transformers raises many types for a missing or damaged tokenizer
            raise InputError(f"--target {args.target}: cannot load its tokenizer ({type(exc).__name__}: {exc}); "
                             f"the target directory needs tokenizer files") from exc
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        enc = lambda texts: [np.asarray(tok(t)["input_ids"], np.int32) for t in texts]  # noqa: E731
        stream = TokenStream(enc(texts), eos)
        eval_stream = TokenStream(enc(eval_texts), eos) if eval_texts else None
        # the settings and the checkpoint directory, before anything is written
        check_train_args(target, stream, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                         ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, aux_layers=args.aux_layers,
                         seed=args.seed, attention=args.attention, eval_stream=eval_stream,
                         eval_every=args.eval_every if eval_stream else 0)
        cfg, used = plan_draft(target, stream, args.draft_vocab, args.aux_layers, args.rope_theta)
        resumed = check_checkpoints(args.ckpt_dir or out.partial / "checkpoints", target, cfg, used, args.steps)
        with out as work:
            cfg, params, history = train_draft(
                target, stream, steps=args.steps, batch=args.batch, seq_len=args.seq_len, ttt_steps=args.ttt_steps,
                draft_vocab=args.draft_vocab, aux_layers=args.aux_layers,
                optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps),
                ckpt_dir=args.ckpt_dir or work / "checkpoints", seed=args.seed, attention=args.attention,
                eval_stream=eval_stream, eval_every=args.eval_every if eval_stream else 0, rope_theta=args.rope_theta)
            export_draft(work, cfg, params, history=history)
    except (DiffspecError, OSError) as exc:
        return report_error(exc)
    print(json.dumps(history[-1] if history else {"step": resumed, "note": "the checkpoints already held every "
                                                                          "step: exported the last one"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["train_draft", "export_draft", "ttt_logits", "ttt_loss", "draft_vocabulary", "draft_config_for",
           "read_texts"]
