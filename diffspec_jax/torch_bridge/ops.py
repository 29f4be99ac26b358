"""DiffSpec operations in PyTorch: RoPE, chunk scoring (contiguous and paged K caches), chunk selection, history
construction, gather-RoPE-write and working-cache draft attention.

Every function has the contract of its JAX reference (same argument order, shapes and results up to float
rounding); the references are:

=============================  ==========================================================================
here                           JAX reference
=============================  ==========================================================================
:func:`rope_cos_sin`           ``diffspec_jax.models.layers.rope_cos_sin``
:func:`apply_rope`             ``diffspec_jax.models.layers.apply_rope``
:func:`head_sum_scores`        ``diffspec_jax.retrieval.head_sum_scores``
:func:`chunk_scores`           ``diffspec_jax.retrieval.chunk_scores_reference``
:func:`paged_head_sum_scores`  ``head_sum_scores`` of the cache the block table describes
:func:`paged_chunk_scores`     ``chunk_scores_reference`` of the cache the block table describes
:func:`salience_scores`        ``diffspec_jax.retrieval.salience_scores``
:func:`update_chunk_sums`      ``diffspec_jax.retrieval.update_chunk_sums``
:func:`select_chunks`          ``diffspec_jax.retrieval.select_chunks`` (with the redundancy penalty)
:func:`history_indices`        ``diffspec_jax.working_cache.history_indices``
:func:`gather_rope_write`      ``diffspec_jax.working_cache.gather_rope_write_reference`` (writes in place)
:func:`draft_attention`        ``diffspec_jax.working_cache.draft_attention_reference``
=============================  ==========================================================================

Conventions: heads are an explicit axis (``[B, T, heads, D]``); statistics, softmax and log-sum-exp are float32
whatever the input dtype (bfloat16, float16 or float32); index vectors are ``-1`` padded. Chunk scoring visits
the K cache in tiles of positions (never more than ``[B, Hq, tile]`` logits) and only up to the largest root.
Only torch and NumPy are used: these functions run wherever torch runs (CPU, CUDA, Ascend through torch_npu).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from diffspec_jax.torch_bridge.errors import BridgeInputError

#: finite "minus infinity" for masked attention logits (keeps exp() and max() free of NaN), as in the JAX layers
NEG_INF = -1e30
#: the score of a chunk that cannot be selected
NO_SCORE = float("-inf")
#: positions per scoring tile
SCORE_TILE = 2048


def num_chunks(length: int, chunk: int) -> int:
    """``ceil(length / chunk)``."""
    return -(-length // chunk)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise BridgeInputError(message)


def _as_index(x, device: torch.device, name: str) -> torch.Tensor:
    """int64 tensor on ``device`` from a tensor, NumPy array or sequence."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    _check(not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
           f"{name} must hold integers, got dtype {t.dtype}")
    return t.to(device=device, dtype=torch.int64)


# ------------------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, inv_freq) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions.

    Args:
        positions: int ``[...]`` absolute or local positions.
        inv_freq: float32 ``[R/2]`` (``RopeConfig.inv_freq(head_dim)``; NumPy array or tensor).
    Returns:
        ``(cos, sin)``, float32 ``[..., R/2]`` each, on ``positions.device``.
    """
    inv = torch.as_tensor(np.asarray(inv_freq, np.float32) if not isinstance(inv_freq, torch.Tensor) else inv_freq,
                          dtype=torch.float32, device=positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of every head; the rest pass through.

    Args:
        x: ``[B, T, heads, D]`` any float dtype.
        cos, sin: float32 ``[B, T, R/2]`` (or broadcastable, e.g. ``[1, T, R/2]``).
        interleaved: rotate pairs ``(x0, x1), (x2, x3), ...`` (GPT-J) instead of halves (Llama rotate-half).
    Returns:
        ``[B, T, heads, D]`` in ``x.dtype``; arithmetic in float32.
    """
    half = cos.shape[-1]
    _check(2 * half <= x.shape[-1], f"apply_rope: {2 * half} rotary dims exceed head_dim {x.shape[-1]}")
    rot, rest = x[..., : 2 * half].to(torch.float32), x[..., 2 * half:]
    c, s = cos[:, :, None, :].to(torch.float32), sin[:, :, None, :].to(torch.float32)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    out = out.to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


# ---------------------------------------------------------------------------------------------- scoring
def _check_scoring(q: torch.Tensor, lse: torch.Tensor | None, hkv: int, d: int, root: torch.Tensor, what: str):
    _check(q.dim() == 3, f"{what}: q must be [B, Hq, D], got shape {tuple(q.shape)}")
    b, hq, dq = q.shape
    _check(dq == d, f"{what}: q head_dim {dq} does not match the K cache head_dim {d}")
    _check(hq % hkv == 0, f"{what}: {hq} query heads are not a multiple of {hkv} KV heads")
    _check(root.shape == (b,), f"{what}: root must be [B] = [{b}], got shape {tuple(root.shape)}")
    if lse is not None:
        _check(tuple(lse.shape) == (b, hq), f"{what}: lse must be [B, Hq] = [{b}, {hq}], got {tuple(lse.shape)}")


def _probability_mass(q: torch.Tensor, lse: torch.Tensor | None, key_tile: Callable[[int, int], torch.Tensor],
                      hkv: int, s_len: int, stop: int, tile: int, root: torch.Tensor) -> torch.Tensor:
    """``sum_h p_h(t)`` float32 ``[B, s_len]``; positions ``>= stop`` (past every root) stay 0.

    ``key_tile(s0, s1)`` returns the keys of positions ``s0..s1-1`` as ``[B, s1 - s0, Hkv, D]``.
    """
    b, hq, d = q.shape
    g = hq // hkv
    qg = q.to(torch.float32).reshape(b, hkv, g, d)
    scale = d ** -0.5
    bounds = [(s0, min(s0 + tile, stop)) for s0 in range(0, stop, tile)]

    def logits(s0, s1):
        k = key_tile(s0, s1).to(torch.float32)
        x = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale
        valid = torch.arange(s0, s1, device=q.device)[None, :] <= root[:, None]  # [B, t]
        return x, valid

    if lse is None:  # online log-sum-exp over positions 0..r
        m = torch.full((b, hkv, g), float("-inf"), device=q.device)
        acc = torch.zeros((b, hkv, g), device=q.device)
        for s0, s1 in bounds:
            x, valid = logits(s0, s1)
            x = x.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, x.amax(dim=-1))
            ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            acc = acc * torch.exp(m - ref) + torch.exp(x - ref[..., None]).sum(dim=-1)
            m = m_new
        lse_g = m + torch.log(acc)
    else:
        lse_g = lse.to(torch.float32).reshape(b, hkv, g)
    mass = torch.zeros((b, s_len), dtype=torch.float32, device=q.device)
    for s0, s1 in bounds:
        x, valid = logits(s0, s1)
        p = torch.exp(x - lse_g[..., None]).masked_fill(~valid[:, None, None, :], 0.0)
        mass[:, s0:s1] = p.sum(dim=(1, 2))
    return mass


def _per_chunk(mass: torch.Tensor, root: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean of ``mass [B, S]`` over the valid tokens (``<= r``) of each chunk -> float32 ``[B, ceil(S / C)]``."""
    b, s_len = mass.shape
    nc = num_chunks(s_len, chunk)
    per = torch.nn.functional.pad(mass, (0, nc * chunk - s_len)).reshape(b, nc, chunk).sum(dim=-1)
    start = torch.arange(nc, device=mass.device)[None, :] * chunk
    counts = (torch.clamp(root, max=s_len - 1)[:, None] + 1 - start).clamp(0, chunk)
    return torch.where(counts > 0, per / counts.clamp(min=1), torch.zeros_like(per))


def _stop(root: torch.Tensor, s_len: int) -> int:
    return min(s_len, int(root.max()) + 1) if root.numel() else 0


def head_sum_scores(q: torch.Tensor, lse: torch.Tensor | None, k_cache: torch.Tensor, root, chunk: int, *,
                    tile: int = SCORE_TILE) -> torch.Tensor:
    """``sum_h score_h(c)`` over the query heads present in ``q`` (contiguous K cache).

    Args:
        q: ``[B, Hq, D]`` post-RoPE query rows of the scoring layer (any float dtype; used in float32).
        lse: float32 ``[B, Hq]`` their log-sum-exp over positions ``0..r`` from the verify pass, or ``None``
            to recompute it here (both give the same scores).
        k_cache: ``[B, S, Hkv, D]`` post-RoPE keys of the scoring layer (GQA: ``Hq % Hkv == 0``).
        root: int ``[B]`` r, the last committed position of each row (``r < S``).
        chunk: C (``S`` need not be a multiple; the last chunk is partial).
        tile: positions per step (bounds the logits held at once to ``[B, Hq, tile]``).
    Returns:
        float32 ``[B, ceil(S / C)]``: per chunk, the mean over its tokens ``<= r`` of the summed probabilities;
        chunks with no token ``<= r`` score 0.
    """
    return _contiguous_scores(q, lse, k_cache, root, chunk, tile=tile, rows=None)


def _contiguous_scores(q, lse, k_cache, root, chunk, *, tile, rows):
    """:func:`head_sum_scores` of the batch rows ``rows`` of ``k_cache`` (no copy of the other rows)."""
    _check(k_cache.dim() == 4, f"chunk scores: k_cache must be [B, S, Hkv, D], got shape {tuple(k_cache.shape)}")
    root = _as_index(root, q.device, "root")
    _check_scoring(q, lse, k_cache.shape[2], k_cache.shape[3], root, "chunk scores")
    s_len = k_cache.shape[1]
    n_rows = k_cache.shape[0] if rows is None else rows.shape[0]
    _check(n_rows == q.shape[0], f"chunk scores: k_cache has {n_rows} rows but q has {q.shape[0]}")
    _check(bool(((root >= 0) & (root < s_len)).all()) if root.numel() else True,
           f"chunk scores: every root must lie in [0, {s_len}) (the K cache length), got {root.tolist()}")

    def key_tile(s0, s1):
        return k_cache[:, s0:s1] if rows is None else k_cache[rows, s0:s1]

    mass = _probability_mass(q, lse, key_tile, k_cache.shape[2], s_len, _stop(root, s_len), tile, root)
    return _per_chunk(mass, root, chunk)


def chunk_scores(q: torch.Tensor, lse: torch.Tensor | None, k_cache: torch.Tensor, root, chunk: int, *,
                 tile: int = SCORE_TILE) -> torch.Tensor:
    """Attention-probability chunk scores (docs/method.md section 2): :func:`head_sum_scores` divided by ``Hq``.

    Under tensor parallelism each rank calls :func:`head_sum_scores` on its heads, all-reduces (sum) and divides
    by the global head count, so every rank selects the same chunks.
    """
    return head_sum_scores(q, lse, k_cache, root, chunk, tile=tile) / q.shape[1]


def paged_head_sum_scores(q: torch.Tensor, lse: torch.Tensor | None, k_pool: torch.Tensor,
                          block_table: torch.Tensor, root, chunk: int, *, tile: int = SCORE_TILE) -> torch.Tensor:
    """:func:`head_sum_scores` over a paged K cache.

    Args:
        k_pool: ``[num_blocks, block_size, Hkv, D]`` post-RoPE keys of the scoring layer.
        block_table: int ``[B, max_blocks]``: position t of row b lives at
            ``k_pool[block_table[b, t // block_size], t % block_size]``. Entries past a row's root may be
            anything (``-1`` padding included); the blocks up to the root must be valid pool indices.
        q, lse, root, chunk: as in :func:`head_sum_scores`; the logical length is ``S = max_blocks * block_size``.
        tile: positions per step (rounded up to whole blocks).
    Returns:
        float32 ``[B, ceil(S / C)]``, equal to :func:`head_sum_scores` of the contiguous cache the table describes.
    """
    _check(k_pool.dim() == 4, f"paged chunk scores: k_pool must be [num_blocks, block_size, Hkv, D], got shape "
                              f"{tuple(k_pool.shape)}")
    _check(block_table.dim() == 2 and block_table.shape[0] == q.shape[0],
           f"paged chunk scores: block_table must be [B, max_blocks] with B = {q.shape[0]}, got shape "
           f"{tuple(block_table.shape)}")
    root = _as_index(root, q.device, "root")
    _check_scoring(q, lse, k_pool.shape[2], k_pool.shape[3], root, "paged chunk scores")
    num_blocks, bs = k_pool.shape[0], k_pool.shape[1]
    table = block_table.to(device=k_pool.device, dtype=torch.int64)
    s_len = table.shape[1] * bs
    _check(bool(((root >= 0) & (root < s_len)).all()) if root.numel() else True,
           f"paged chunk scores: every root must lie in [0, {s_len}) (max_blocks x block_size), got "
           f"{root.tolist()}")
    needed = torch.arange(table.shape[1], device=table.device)[None, :] <= (root.to(table.device) // bs)[:, None]
    bad = needed & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise BridgeInputError(f"paged chunk scores: block_table[{b}, {j}] = {int(table[b, j])} is not a block of "
                               f"the pool (0..{num_blocks - 1}) but covers positions up to root {int(root[b])}")
    table = table.clamp(0, num_blocks - 1)
    tile = max(1, -(-tile // bs)) * bs

    def key_tile(s0, s1):
        blocks = table[:, s0 // bs: -(-s1 // bs)]
        k = k_pool[blocks].reshape(table.shape[0], -1, k_pool.shape[2], k_pool.shape[3])
        return k[:, : s1 - s0]

    stop = _stop(root, s_len)
    stop = min(s_len, -(-stop // bs) * bs)
    mass = _probability_mass(q, lse, key_tile, k_pool.shape[2], s_len, stop, tile, root)
    return _per_chunk(mass, root, chunk)


def paged_chunk_scores(q: torch.Tensor, lse: torch.Tensor | None, k_pool: torch.Tensor, block_table: torch.Tensor,
                       root, chunk: int, *, tile: int = SCORE_TILE) -> torch.Tensor:
    """:func:`chunk_scores` over a paged K cache (see :func:`paged_head_sum_scores`)."""
    return paged_head_sum_scores(q, lse, k_pool, block_table, root, chunk, tile=tile) / q.shape[1]


def salience_scores(draft_q: torch.Tensor, chunk_sum: torch.Tensor, root, chunk: int) -> torch.Tensor:
    """Chunk scores from summaries: mean over draft query heads of ``q_h . mean_key_{g(h)}(c) / sqrt(D)``.

    Args:
        draft_q: ``[B, Hq, D]`` draft root query (pre-RoPE); chunk_sum: float32 ``[B, Nc, Hkv, D]`` sums of
            committed pre-RoPE draft keys per chunk; root: int ``[B]``.
    Returns:
        float32 ``[B, Nc]`` (``-inf`` for chunks with no token ``<= r``).
    """
    _check(draft_q.dim() == 3 and chunk_sum.dim() == 4 and draft_q.shape[0] == chunk_sum.shape[0]
           and draft_q.shape[2] == chunk_sum.shape[3] and draft_q.shape[1] % chunk_sum.shape[2] == 0,
           f"salience scores: draft_q [B, Hq, D] {tuple(draft_q.shape)} does not fit chunk_sum [B, Nc, Hkv, D] "
           f"{tuple(chunk_sum.shape)}")
    b, hq, d = draft_q.shape
    nc, hkv = chunk_sum.shape[1], chunk_sum.shape[2]
    root = _as_index(root, chunk_sum.device, "root")
    counts = (root[:, None] + 1 - torch.arange(nc, device=chunk_sum.device)[None, :] * chunk).clamp(0, chunk)
    mean_k = chunk_sum.to(torch.float32) / counts.clamp(min=1)[:, :, None, None]
    s = torch.einsum("bkgd,bckd->bc", draft_q.to(torch.float32).reshape(b, hkv, hq // hkv, d), mean_k)
    s = s * (d ** -0.5) / hq
    return torch.where(counts > 0, s, torch.full_like(s, NO_SCORE))


def update_chunk_sums(chunk_sum: torch.Tensor, k: torch.Tensor, positions, valid, chunk: int) -> torch.Tensor:
    """Add committed pre-RoPE draft keys to the per-chunk sums (a new tensor; the input is not modified).

    Args:
        chunk_sum: float32 ``[B, Nc, Hkv, D]``; k: ``[B, T, Hkv, D]``; positions: int ``[B, T]``;
        valid: bool ``[B, T]`` rows to add. Rows whose chunk ``positions // C`` is outside ``0..Nc-1`` are dropped.
    Returns:
        float32 ``[B, Nc, Hkv, D]``.
    """
    out = chunk_sum.clone()
    rows = torch.arange(k.shape[0], device=chunk_sum.device)
    add_chunk_sums_(out, rows, k, positions, valid, chunk)
    return out


def add_chunk_sums_(chunk_sum: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, positions, valid, chunk: int
                    ) -> torch.Tensor:
    """In-place :func:`update_chunk_sums` into batch rows ``rows [B]`` of ``chunk_sum [R, Nc, Hkv, D]``."""
    _check(k.dim() == 4 and tuple(k.shape[2:]) == tuple(chunk_sum.shape[2:]),
           f"chunk sums: k must be [B, T, Hkv, D] with [Hkv, D] = {tuple(chunk_sum.shape[2:])}, got "
           f"{tuple(k.shape)}")
    dev = chunk_sum.device
    positions = _as_index(positions, dev, "positions")
    valid = torch.as_tensor(valid, device=dev).to(torch.bool)
    _check(tuple(positions.shape) == tuple(k.shape[:2]) == tuple(valid.shape),
           f"chunk sums: positions {tuple(positions.shape)} and valid {tuple(valid.shape)} must be [B, T] = "
           f"{tuple(k.shape[:2])}")
    cidx = torch.div(positions, chunk, rounding_mode="floor")
    keep = valid & (positions >= 0) & (cidx < chunk_sum.shape[1])
    add = k.to(device=dev, dtype=torch.float32) * keep[..., None, None]
    ridx = rows.to(dev)[:, None].expand_as(cidx)
    chunk_sum.index_put_((ridx.reshape(-1), cidx.clamp(0, chunk_sum.shape[1] - 1).reshape(-1)),
                         add.reshape(-1, *add.shape[2:]), accumulate=True)
    return chunk_sum


# -------------------------------------------------------------------------------------------- selection
def select_chunks(scores: torch.Tensor, root, chunk: int, max_chunks: int, keep_sink: bool,
                  redundancy_weight: float = 0.0, summaries: torch.Tensor | None = None) -> torch.Tensor:
    """Select the anchor chunks (docs/method.md section 3.1).

    The newest chunk ``floor(r / C)`` is always kept (and returned separately by the caller's rule), chunk 0 too
    when ``keep_sink``; the other ``Nmax - 1`` (``Nmax - 2`` with the sink) slots take the top-scoring complete
    chunks, ties toward the lower index.

    Args:
        scores: float ``[B, Nc]``; root: int ``[B]``; chunk: C; max_chunks: Nmax = Hb / C.
        keep_sink: always keep chunk 0.
        redundancy_weight: lambda >= 0; with ``summaries [B, Nc, ...]`` a chunk's score is discounted by
            ``lambda * max cosine similarity`` to the chunks already selected (greedy, one chunk at a time,
            starting from the newest chunk and the sink).
    Returns:
        int32 ``[B, Nmax - 1]`` anchor chunk ids (every selected chunk except the newest), sorted ascending and
        ``-1`` padded. When all ``ceil((r + 1) / C)`` chunks fit, every complete chunk is an anchor.
    """
    _check(scores.dim() == 2, f"select_chunks: scores must be [B, Nc], got shape {tuple(scores.shape)}")
    _check(max_chunks >= (2 if keep_sink else 1), f"select_chunks: max_chunks {max_chunks} is too small"
                                                  f"{' with the sink chunk' if keep_sink else ''}")
    b, nc = scores.shape
    dev = scores.device
    root = _as_index(root, dev, "root")
    _check(tuple(root.shape) == (b,), f"select_chunks: root must be [B] = [{b}], got {tuple(root.shape)}")
    newest = torch.div(root, chunk, rounding_mode="floor")
    ids = torch.arange(nc, device=dev)[None, :]
    candidate = ids < newest[:, None]  # complete chunks only; the newest is kept separately
    forced = (ids == 0) & candidate if keep_sink else torch.zeros((b, nc), dtype=torch.bool, device=dev)
    free_slots = max_chunks - 1
    score = torch.where(candidate & ~forced, scores.to(torch.float32), torch.full((b, nc), NO_SCORE, device=dev))
    n_pick = max(0, free_slots - (1 if keep_sink else 0))
    if redundancy_weight > 0 and summaries is not None:
        _check(summaries.shape[:2] == scores.shape, f"select_chunks: summaries must be [B, Nc, ...] with [B, Nc] = "
                                                    f"{tuple(scores.shape)}, got {tuple(summaries.shape)}")
        picked = _greedy_redundancy(score, forced, newest, summaries.reshape(b, nc, -1).to(torch.float32), n_pick,
                                    float(redundancy_weight))
    else:
        order = torch.sort(-score, dim=1, stable=True).indices[:, :n_pick]  # stable: ties toward the lower index
        ok = torch.gather(score, 1, order) > NO_SCORE
        picked = torch.zeros((b, nc), dtype=torch.bool, device=dev).scatter(1, order, ok)
    chosen = picked | forced
    anchors = torch.sort(torch.where(chosen, ids.expand(b, nc), nc), dim=1).values[:, :free_slots]
    anchors = torch.where(anchors == nc, -1, anchors)
    if anchors.shape[1] < free_slots:  # fewer chunks than slots (a short cache): pad, as the JAX reference does
        anchors = torch.nn.functional.pad(anchors, (0, free_slots - anchors.shape[1]), value=-1)
    return anchors.to(torch.int32)


def _greedy_redundancy(score, forced, newest, summaries, n_pick, weight):
    """Greedy selection with ``score(c) - weight * max cosine similarity`` to the chunks selected so far."""
    b, nc = score.shape
    unit = summaries / summaries.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    rows = torch.arange(b, device=score.device)

    def sim_to(c):
        return torch.einsum("bcf,bf->bc", unit, unit[rows, c.clamp(0, nc - 1)])

    sim_max = sim_to(newest)  # the newest chunk is always selected first
    sim_max = torch.where(forced.any(dim=1, keepdim=True), torch.maximum(sim_max, sim_to(newest * 0)), sim_max)
    chosen = forced.clone()
    for _ in range(n_pick):
        adjusted = torch.where(chosen, torch.full_like(score, NO_SCORE), score - weight * sim_max)
        best = adjusted.argmax(dim=1)  # the first maximum: ties toward the lower index
        ok = adjusted[rows, best] > NO_SCORE
        chosen = chosen | (torch.nn.functional.one_hot(best, nc).to(torch.bool) & ok[:, None])
        sim_max = torch.where(ok[:, None], torch.maximum(sim_max, sim_to(best)), sim_max)
    return chosen & ~forced


# ---------------------------------------------------------------------------------------------- history
def history_indices(anchor_chunks: torch.Tensor | None, root, chunk: int, slots: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's history at step 0: anchor tokens plus a rolling window of the most recent other positions.

    ``history = anchor tokens U W`` (sorted), W = the most recent positions ``< r`` that are not anchor tokens,
    up to ``slots - |anchor tokens|`` of them (docs/method.md section 3.2). The root is never included.

    Args:
        anchor_chunks: int ``[B, A]`` selected complete chunk ids (``-1`` = empty), or ``None`` (no anchors: a
            sliding window of the last ``slots`` positions).
        root: int ``[B]`` root position r; chunk: C; slots: the history budget Hb.
    Returns:
        ``(idx, n, window)``: int32 ``[B, slots]`` sorted absolute positions padded with ``-1``, int32 ``[B]``
        history length n, int32 ``[B]`` |W|.
    """
    dev = anchor_chunks.device if anchor_chunks is not None else (
        root.device if isinstance(root, torch.Tensor) else torch.device("cpu"))
    root = _as_index(root, dev, "root")
    _check(root.dim() == 1, f"history_indices: root must be [B], got shape {tuple(root.shape)}")
    b = root.shape[0]
    cand = root[:, None] - slots + torch.arange(slots, device=dev)[None, :]  # the last `slots` positions before r
    if anchor_chunks is None:
        idx = torch.where(cand >= 0, cand, -1)
        n = torch.clamp(root, min=0, max=slots).to(torch.int32)
        return _compact_sorted(idx, slots), n, n.clone()
    _check(anchor_chunks.dim() == 2 and anchor_chunks.shape[0] == b,
           f"history_indices: anchor_chunks must be [B, A] with B = {b}, got shape {tuple(anchor_chunks.shape)}")
    anchors = anchor_chunks.to(torch.int64)
    valid_anchor = anchors >= 0
    tok = anchors[:, :, None] * chunk + torch.arange(chunk, device=dev)
    anchor_tok = torch.where(valid_anchor[:, :, None], tok, -1).reshape(b, -1)
    anchor_tok = torch.where(anchor_tok < root[:, None], anchor_tok, -1)
    n_anchor = (anchor_tok >= 0).sum(dim=1)
    cand_chunk = torch.div(cand, chunk, rounding_mode="floor")
    in_anchor = (valid_anchor[:, None, :] & (cand_chunk[:, :, None] == anchors[:, None, :])).any(dim=2)
    free = (cand >= 0) & ~in_anchor
    rank_from_top = free.flip(1).to(torch.int64).cumsum(dim=1).flip(1)  # 1 = the most recent free position
    take = free & (rank_from_top <= (slots - n_anchor)[:, None])
    window = torch.where(take, cand, -1)
    w = take.sum(dim=1)
    idx = _compact_sorted(torch.cat([anchor_tok, window], dim=1), slots)
    return idx, (n_anchor + w).to(torch.int32), w.to(torch.int32)


def _compact_sorted(idx: torch.Tensor, slots: int) -> torch.Tensor:
    """Sort valid entries (>= 0) ascending to the front, pad with -1, keep ``slots`` columns (int32)."""
    big = torch.iinfo(torch.int64).max
    s = torch.sort(torch.where(idx >= 0, idx, big), dim=1).values[:, :slots]
    return torch.where(s == big, -1, s).to(torch.int32)


# ------------------------------------------------------------------------------------ working cache
def gather_rope_write(store_k: torch.Tensor, store_v: torch.Tensor, work_k: torch.Tensor, work_v: torch.Tensor,
                      idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                      store_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild the working cache in place: ``work[b, 0:N] = rope(store[row_b, idx[b]], local 0..N-1)``.

    Args:
        store_k, store_v: ``[R, S, Hkv, D]`` pre-RoPE canonical store.
        work_k, work_v: ``[B, W, Hkv, D]`` working cache: rows ``0..N-1`` are overwritten, rows ``N..W-1`` kept.
        idx: int ``[B, N]`` absolute positions to gather, ``-1`` = padding (written as zero rows), ``N <= W``.
        cos, sin: float32 ``[N, R/2]`` RoPE tables of local positions ``0..N-1`` (R = rotary dims <= D).
        interleaved: rotate pairs ``(2j, 2j+1)`` instead of halves ``(j, j + R/2)``.
        store_rows: int ``[B]`` the store row of each working-cache row (default ``0..B-1``; ``R == B``).
    Returns:
        ``(work_k, work_v)``, the same tensors, written: keys rotated at local positions, values copied
        (store dtype -> work dtype).
    """
    _check(store_k.dim() == 4 and store_v.shape == store_k.shape,
           f"gather_rope_write: store_k/store_v must be equal [R, S, Hkv, D], got {tuple(store_k.shape)} and "
           f"{tuple(store_v.shape)}")
    _check(work_k.dim() == 4 and work_v.shape == work_k.shape and work_k.shape[2:] == store_k.shape[2:],
           f"gather_rope_write: work_k/work_v must be equal [B, W, Hkv, D] with [Hkv, D] = "
           f"{tuple(store_k.shape[2:])}, got {tuple(work_k.shape)} and {tuple(work_v.shape)}")
    b, w = work_k.shape[:2]
    _check(idx.dim() == 2 and idx.shape[0] == b, f"gather_rope_write: idx must be [B, N] with B = {b}, got "
                                                 f"{tuple(idx.shape)}")
    n = idx.shape[1]
    _check(n <= w, f"gather_rope_write: {n} history rows do not fit a working cache of {w} slots")
    _check(cos.shape == sin.shape and cos.dim() == 2 and cos.shape[0] == n,
           f"gather_rope_write: cos/sin must be [N, R/2] with N = {n}, got {tuple(cos.shape)}")
    dev = store_k.device
    idx = idx.to(device=dev, dtype=torch.int64)
    if store_rows is None:
        _check(store_k.shape[0] == b, f"gather_rope_write: the store has {store_k.shape[0]} rows and the working "
                                      f"cache {b}; pass store_rows")
        rows = torch.arange(b, device=dev)
    else:
        rows = _as_index(store_rows, dev, "store_rows")
        _check(tuple(rows.shape) == (b,), f"gather_rope_write: store_rows must be [B] = [{b}], got "
                                          f"{tuple(rows.shape)}")
    safe = idx.clamp(min=0)
    valid = (idx >= 0)[:, :, None, None]
    k = store_k[rows[:, None], safe].masked_fill(~valid, 0)
    v = store_v[rows[:, None], safe].masked_fill(~valid, 0)
    k = apply_rope(k, cos[None].to(dev), sin[None].to(dev), interleaved=interleaved)
    work_k[:, :n] = k.to(work_k.dtype)
    work_v[:, :n] = v.to(work_v.dtype)
    return work_k, work_v


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_local, *, scale: float) -> torch.Tensor:
    """Draft attention over the working cache (GQA, causal over local slot positions, float32 softmax).

    Args:
        q: ``[B, T, Hq, D]`` rotated queries; k, v: ``[B, W, Hkv, D]`` working cache (``Hq % Hkv == 0``).
        q_local: int ``[B, T]`` local positions: slot s is visible to a query at position p iff ``s <= p``.
        scale: softmax scale (``1 / sqrt(D)``).
    Returns:
        ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    _check(q.dim() == 4 and k.dim() == 4 and v.shape[:3] == k.shape[:3] and q.shape[0] == k.shape[0]
           and q.shape[3] == k.shape[3] and q.shape[2] % k.shape[2] == 0,
           f"draft_attention: q [B, T, Hq, D] {tuple(q.shape)} does not fit k/v [B, W, Hkv, D] {tuple(k.shape)} / "
           f"{tuple(v.shape)}")
    b, t, hq, d = q.shape
    w, hkv = k.shape[1], k.shape[2]
    q_local = _as_index(q_local, q.device, "q_local")
    _check(tuple(q_local.shape) == (b, t), f"draft_attention: q_local must be [B, T] = [{b}, {t}], got "
                                           f"{tuple(q_local.shape)}")
    qg = q.to(torch.float32).reshape(b, t, hkv, hq // hkv, d)
    s = torch.einsum("btkgd,bskd->bkgts", qg, k.to(torch.float32)) * scale
    visible = torch.arange(w, device=q.device)[None, None, :] <= q_local[:, :, None]  # [B, T, W]
    s = s.masked_fill(~visible[:, None, None], NEG_INF)
    p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
    out = torch.einsum("bkgts,bskd->btkgd", p.to(v.dtype).to(torch.float32), v.to(torch.float32))
    return out.reshape(b, t, hq, v.shape[-1]).to(q.dtype)


__all__: Sequence[str] = (
    "add_chunk_sums_", "apply_rope", "chunk_scores", "draft_attention", "gather_rope_write", "head_sum_scores",
    "history_indices", "num_chunks", "paged_chunk_scores", "paged_head_sum_scores", "rope_cos_sin",
    "salience_scores", "select_chunks", "update_chunk_sums",
)
