"""The DiffSpec draft-side runtime of a torch serving engine (vLLM-style, CUDA or Ascend).

:class:`DiffspecRuntime` owns, per request slot, the draft's canonical pre-RoPE K/V store, the retrieval
selection (anchor chunks), the retrieval cadence and the ``retrieval_status`` counters (docs/method.md sections
4, 5 and 11). An engine calls it at fixed points of its cycle (see ``torch_bridge/README.md``)::

    slot = rt.add_request(rid)                                   # admission: lowest free slot
    rt.on_prefill(rids, k, v, positions)                         # per prefill chunk: draft K/V (pre-RoPE)
    rt.on_prefill_done(rids, root, query=q, lse=lse, keys=K)     # retrieval after prefill (last prompt query)
    # every cycle:
    wc = rt.rebuild(rids, root)                                  # draft step 0: working cache, n, root slot
    ...draft root at wc.root_slot, chain step j at wc.root_slot + j; target verifies...
    rt.on_verify(rids, root, query=q, lse=lse, keys=K, emitted=m + 1)   # cadence + retrieval if due
    rt.on_commit(rids, k, v, positions)                          # K/V of the newly committed draft entries
    rt.finish(rid) / rt.cancel(rid)                              # frees the slot

Request ids map to slots that stay stable when the engine reorders its batch: every hook takes the batch's
request ids in batch order. Host-side decisions (cadence, counters) run in Python; device work (scoring,
selection, gather-RoPE-write) runs on the runtime's device with static buffer shapes.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from diffspec_jax.config import DiffSpec, RopeConfig, SpecConfig
from diffspec_jax.retrieval_control import ADDITIVE, RetrievalControl, RetrievalCounters
from diffspec_jax.torch_bridge import ops
from diffspec_jax.torch_bridge.device import resolve_dtype, select_device
from diffspec_jax.torch_bridge.errors import BridgeError, BridgeInputError, SlotError

#: the per-request counters (shared with the JAX engine)
SlotCounters = RetrievalCounters


@dataclass(frozen=True)
class PagedKeys:
    """A paged K cache of the scoring layer.

    Attributes:
        pool: ``[num_blocks, block_size, Hkv, D]`` post-RoPE keys.
        block_table: int ``[B, max_blocks]`` in batch order: position t of row b is
            ``pool[block_table[b, t // block_size], t % block_size]``.
    """

    pool: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True)
class WorkingCache:
    """The draft's view for one cycle, returned by :meth:`DiffspecRuntime.rebuild` (batch order).

    Attributes:
        k, v: ``[B, W, Hkv, D]`` (W = ``diffspec_token_budget``): history keys rotated at local positions
            ``0..n-1``, values copied; views into the runtime's buffer, valid until the next :meth:`rebuild`.
        n: int32 ``[B]`` history length; root_slot: int64 ``[B]`` the root's local position and slot (= n);
            chain step j goes to ``root_slot + j``.
        history: int32 ``[B, Hb]`` the absolute positions in slots ``0..n-1`` (``-1`` padded).
        window: int32 ``[B]`` how many of them belong to the rolling window (the rest are anchor tokens).
    """

    k: torch.Tensor
    v: torch.Tensor
    n: torch.Tensor
    root_slot: torch.Tensor
    history: torch.Tensor
    window: torch.Tensor


class DiffspecRuntime:
    """Draft-side DiffSpec state of a serving engine: slots, canonical store, selection, cadence, counters.

    Args:
        spec: a :class:`~diffspec_jax.SpecConfig` with ``draft_context_policy="diffspec"`` (chunk size, budget,
            K, interval, sink, after-prefill retrieval, adaptive interval, scorer, redundancy weight).
        max_slots: concurrent requests (slots); also the largest batch.
        max_len: store capacity per slot in positions (the engine's maximum sequence length).
        num_kv_heads, head_dim: the draft's KV heads on this rank and head dimension.
        rope: the draft's :class:`~diffspec_jax.RopeConfig` (theta, llama3 scaling, partial rotary, interleaved).
        dtype: K/V storage dtype (``"bfloat16"``, ``"float16"``, ``"float32"`` or a torch dtype).
        device: ``None`` = :func:`~diffspec_jax.torch_bridge.select_device` (npu > cuda > cpu).

    Memory: store ``2 * max_slots * max_len * Hkv * D`` elements, working cache ``2 * max_slots * W * Hkv * D``,
    plus float32 chunk key sums ``max_slots * ceil(max_len / C) * Hkv * D`` for the salience scorer or the
    redundancy penalty.
    """

    def __init__(self, spec: SpecConfig, *, max_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 rope: RopeConfig | None = None, dtype: str | torch.dtype = "bfloat16",
                 device: str | torch.device | None = None):
        if not isinstance(spec, SpecConfig):
            raise BridgeError(f"spec must be a diffspec_jax.SpecConfig, got {type(spec).__name__}")
        if not spec.context.retrieves:
            raise BridgeError(f"the torch bridge runtime implements draft_context_policy={DiffSpec.policy!r}, got "
                              f"{spec.context.policy!r}")
        for name, value in (("max_slots", max_slots), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise BridgeError(f"{name} must be a positive integer, got {value!r}")
        self.spec = spec.with_default_interval(self_draft=False)  # the bridge serves a draft model
        self.rope = rope if rope is not None else RopeConfig()
        self.device = select_device(device)
        self.dtype = resolve_dtype(dtype)
        self.max_slots, self.max_len = int(max_slots), int(max_len)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.chunk = spec.context.chunk_size
        self.history_budget = spec.history_budget
        self.max_chunks = spec.max_chunks
        self.capacity = spec.context.token_budget
        self.inv_freq = torch.as_tensor(self.rope.inv_freq(self.head_dim), device=self.device)
        shape = (self.max_slots, self.max_len + 1, self.num_kv_heads, self.head_dim)  # row max_len: scratch
        self._store_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._store_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        wshape = (self.max_slots, self.capacity, self.num_kv_heads, self.head_dim)
        self._work_k = torch.zeros(wshape, dtype=self.dtype, device=self.device)
        self._work_v = torch.zeros(wshape, dtype=self.dtype, device=self.device)
        self._anchors = torch.full((self.max_slots, self.max_chunks - 1), -1, dtype=torch.int32, device=self.device)
        self._chunk_sum = None
        if spec.context.needs_summaries:
            self._chunk_sum = torch.zeros((self.max_slots, ops.num_chunks(self.max_len, self.chunk),
                                           self.num_kv_heads, self.head_dim), dtype=torch.float32,
                                          device=self.device)
        cos, sin = ops.rope_cos_sin(torch.arange(self.history_budget, device=self.device), self.inv_freq)
        self._cos, self._sin = cos, sin
        self._n = torch.zeros((self.max_slots,), dtype=torch.int32, device=self.device)
        self._window = torch.zeros((self.max_slots,), dtype=torch.int32, device=self.device)
        self._slot_of: dict[Hashable, int] = {}
        self._free = list(range(self.max_slots))  # a heap: new requests take the lowest free slot
        self._ctl = RetrievalControl(self.spec, self.max_slots)  # cadence and counters, one entry per slot
        self._stored = [0] * self.max_slots  # 1 + the largest position stored per slot
        self._lifetime = {k: 0 for k in ADDITIVE}

    # ------------------------------------------------------------------------------------------ slots
    def add_request(self, request_id: Hashable) -> int:
        """Register a request; returns its slot (the lowest free one).

        Raises:
            SlotError: the id is already registered, or every slot is in use.
        """
        if request_id in self._slot_of:
            raise SlotError(f"request {request_id!r} is already registered (slot {self._slot_of[request_id]})")
        if not self._free:
            raise SlotError(f"no free draft slot for request {request_id!r}: all {self.max_slots} slots are in use "
                            f"(requests {list(self._slot_of)}); finish or cancel a request, or raise max_slots")
        slot = heapq.heappop(self._free)
        self._slot_of[request_id] = slot
        return slot

    def finish(self, request_id: Hashable) -> int:
        """Release a finished request's slot (clears its selection, counters and lengths); returns the slot."""
        return self._release(request_id, "finish")

    def cancel(self, request_id: Hashable) -> int:
        """Release a cancelled (aborted, preempted) request's slot; same effect as :meth:`finish`."""
        return self._release(request_id, "cancel")

    def _release(self, request_id: Hashable, what: str) -> int:
        slot = self._slot(request_id, what)
        del self._slot_of[request_id]
        c = self._ctl.c[slot]
        for k in ADDITIVE:
            self._lifetime[k] += getattr(c, k)
        self._ctl.reset(slot)
        self._stored[slot] = 0
        self._anchors[slot] = -1
        self._n[slot] = 0
        self._window[slot] = 0
        if self._chunk_sum is not None:
            self._chunk_sum[slot] = 0
        heapq.heappush(self._free, slot)  # store rows are not zeroed: the next prefill overwrites them
        return slot

    def _slot(self, request_id: Hashable, what: str) -> int:
        try:
            return self._slot_of[request_id]
        except (KeyError, TypeError):
            raise SlotError(f"{what}: unknown request id {request_id!r} (registered: {list(self._slot_of)}); "
                            f"call add_request first") from None

    def slot_of(self, request_id: Hashable) -> int:
        """The slot of a registered request."""
        return self._slot(request_id, "slot_of")

    def slots(self, request_ids: Sequence[Hashable]) -> torch.Tensor:
        """int64 ``[B]`` slots of a batch (batch order), on the runtime's device."""
        return torch.as_tensor(self._slot_list(request_ids, "slots"), dtype=torch.int64, device=self.device)

    def _slot_list(self, request_ids: Sequence[Hashable], what: str) -> list[int]:
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise BridgeInputError(f"{what}: request_ids must be a sequence of ids in batch order, got "
                                   f"{type(request_ids).__name__}")
        slots = [self._slot(r, what) for r in request_ids]
        if len(set(slots)) != len(slots):
            raise BridgeInputError(f"{what}: a request id appears twice in the batch {list(request_ids)}")
        if not slots:
            raise BridgeInputError(f"{what}: empty batch")
        return slots

    @property
    def requests(self) -> dict[Hashable, int]:
        """Registered request ids -> slots (a copy)."""
        return dict(self._slot_of)

    # ------------------------------------------------------------------------------------------ store
    @property
    def store_k(self) -> torch.Tensor:
        """``[max_slots, max_len, Hkv, D]`` canonical pre-RoPE keys (a view)."""
        return self._store_k[:, : self.max_len]

    @property
    def store_v(self) -> torch.Tensor:
        """``[max_slots, max_len, Hkv, D]`` canonical values (a view)."""
        return self._store_v[:, : self.max_len]

    def on_prefill(self, request_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor, positions) -> None:
        """Store the draft's pre-RoPE K/V of prompt entries (call once per prefill chunk).

        Args:
            request_ids: the batch's request ids, batch order (B of them).
            k, v: ``[B, T, Hkv, D]`` pre-RoPE K and V of draft entries (entry t pairs the target's aux features of
                token t with token t + 1); any float dtype (stored in the runtime's dtype).
            positions: int ``[B, T]`` absolute positions, ``-1`` = padding (not stored).
        Raises:
            BridgeInputError: shapes that do not match, a position ``>= max_len``, a tensor on another device.
        """
        self._store(request_ids, k, v, positions, "on_prefill")

    def on_commit(self, request_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor, positions) -> None:
        """Store the K/V of the entries committed by the last verification (draft step 0, before :meth:`rebuild`).

        Same arguments as :meth:`on_prefill`. Store only **committed** entries (never rejected drafts).
        """
        self._store(request_ids, k, v, positions, "on_commit")

    def _store(self, request_ids, k, v, positions, what) -> None:
        slots = self._slot_list(request_ids, what)
        b = len(slots)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != b or \
                    tuple(x.shape[2:]) != (self.num_kv_heads, self.head_dim):
                raise BridgeInputError(f"{what}: {name} must be a tensor [B, T, Hkv, D] = [{b}, T, {self.num_kv_heads}"
                                       f", {self.head_dim}], got {tuple(x.shape) if hasattr(x, 'shape') else x!r}")
            if x.device != self.device:
                raise BridgeInputError(f"{what}: {name} is on {x.device} but the runtime lives on {self.device}")
        if k.shape != v.shape:
            raise BridgeInputError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        pos = ops._as_index(positions, self.device, "positions")
        if tuple(pos.shape) != tuple(k.shape[:2]):
            raise BridgeInputError(f"{what}: positions must be [B, T] = {tuple(k.shape[:2])}, got {tuple(pos.shape)}")
        top = pos.max(dim=1).values.tolist() if pos.numel() else [-1] * b
        if max(top) >= self.max_len:
            r = int(np.argmax(top))
            raise BridgeInputError(f"{what}: position {top[r]} of request {request_ids[r]!r} is beyond the store "
                                   f"capacity max_len={self.max_len}")
        if bool((pos < -1).any()):
            raise BridgeInputError(f"{what}: positions must be >= 0, or -1 for padding")
        rows = torch.as_tensor(slots, dtype=torch.int64, device=self.device)[:, None].expand_as(pos)
        dest = torch.where(pos >= 0, pos, self.max_len)  # padding goes to the scratch row
        if self._chunk_sum is not None:  # each position is summed once, when first stored
            fresh = (pos >= 0) & (pos >= torch.as_tensor(self._stored, device=self.device)[rows])
            ops.add_chunk_sums_(self._chunk_sum, rows[:, 0], k, pos, fresh, self.chunk)
        self._store_k[rows, dest] = k.to(self.dtype)
        self._store_v[rows, dest] = v.to(self.dtype)
        for s, t in zip(slots, top):
            self._stored[s] = max(self._stored[s], int(t) + 1)

    # -------------------------------------------------------------------------------------- retrieval
    def on_prefill_done(self, request_ids: Sequence[Hashable], root, *, query: torch.Tensor | None = None,
                        lse: torch.Tensor | None = None, keys: torch.Tensor | PagedKeys | None = None,
                        draft_query: torch.Tensor | None = None) -> list[bool]:
        """End of prefill: the retrieval after prefill (``diffspec_retrieve_after_prefill``, docs/method.md section 4).

        Args:
            request_ids: batch order; root: int ``[B]`` the last prompt position P - 1 of each request.
            query: ``[B, Hq, D]`` the scoring layer's post-RoPE query of the last prompt position; lse: float32
                ``[B, Hq]`` its log-sum-exp over ``0..r`` (``None``: recomputed); keys: the scoring layer's K cache,
                a tensor ``[B, S, Hkv_t, D]`` (batch order) or :class:`PagedKeys` (attention scorer).
            draft_query: ``[B, Hq_d, D]`` the draft's pre-RoPE root query (salience scorer).
        Returns:
            per row, whether it retrieved (rows with ``r <= Hb`` fit whole and skip scoring).
        """
        slots = self._slot_list(request_ids, "on_prefill_done")
        roots = self._roots(root, len(slots), "on_prefill_done")
        if not self.spec.context.retrieve_after_prefill:
            for s in slots:
                self._ctl.skip_prefill(s)
            return [False] * len(slots)
        due = [r > self.history_budget for r in roots]
        self._retrieve(request_ids, slots, roots, due, query, lse, keys, draft_query, after_prefill=True)
        return due

    def on_verify(self, request_ids: Sequence[Hashable], root, *, query: torch.Tensor | None = None,
                  lse: torch.Tensor | None = None, keys: torch.Tensor | PagedKeys | None = None,
                  draft_query: torch.Tensor | None = None, emitted=None) -> list[bool]:
        """One finished verification cycle: count it, and retrieve for the rows that are due.

        A row is due when ``diffspec_retrieval_interval`` cycles (its current interval) have passed since its
        last retrieval; a due row whose root fits the history budget (``r <= Hb``) skips scoring.

        Args:
            request_ids: batch order; root: int ``[B]`` r, the new last committed position (``r0 + m``).
            query, lse, keys, draft_query: as in :meth:`on_prefill_done`, for the committed row r; needed only
                when a row is due (pass them every cycle, or ``None`` when no row can be due).
            emitted: int ``[B]`` tokens emitted this cycle (m + 1), needed with ``diffspec_adaptive_profile``.
        Returns:
            per row, whether it retrieved.
        """
        slots = self._slot_list(request_ids, "on_verify")
        roots = self._roots(root, len(slots), "on_verify")
        if emitted is not None:
            emitted = [int(e) for e in (emitted.tolist() if isinstance(emitted, torch.Tensor) else emitted)]
            if len(emitted) != len(slots):
                raise BridgeInputError(f"on_verify: emitted has {len(emitted)} entries for a batch of {len(slots)}")
        elif self.spec.context.adaptive:
            raise BridgeInputError("on_verify: diffspec_adaptive_profile needs emitted (tokens per cycle, m + 1)")
        due = []
        for i, s in enumerate(slots):
            self._ctl.observe(s, emitted=None if emitted is None else emitted[i])
            due.append(self._ctl.due(s, roots[i]))
        self._retrieve(request_ids, slots, roots, due, query, lse, keys, draft_query, after_prefill=False)
        return due

    def _roots(self, root, b: int, what: str) -> list[int]:
        roots = root.tolist() if isinstance(root, torch.Tensor) else list(np.asarray(root).reshape(-1).tolist())
        if len(roots) != b or not all(isinstance(r, int) for r in roots):
            raise BridgeInputError(f"{what}: root must be {b} integers (one per request), got {roots!r}")
        for r in roots:
            if not 0 <= r < self.max_len:
                raise BridgeInputError(f"{what}: root {r} is outside the store capacity [0, {self.max_len})")
        return roots

    def _retrieve(self, request_ids, slots, roots, due, query, lse, keys, draft_query, *, after_prefill) -> None:
        """Score and select for the due rows; book the retrievals."""
        rows = [i for i, d in enumerate(due) if d]
        if not rows:
            return
        what = "on_prefill_done" if after_prefill else "on_verify"
        b = len(slots)
        t0 = time.perf_counter()
        ridx = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        root_d = torch.as_tensor([roots[i] for i in rows], dtype=torch.int64, device=self.device)
        dslots = torch.as_tensor([slots[i] for i in rows], dtype=torch.int64, device=self.device)
        if self.spec.context.scorer == "attention":
            scores = self._attention_scores(what, b, ridx, root_d, query, lse, keys)
        else:
            if not isinstance(draft_query, torch.Tensor) or draft_query.dim() != 3 or draft_query.shape[0] != b:
                raise BridgeInputError(f"{what}: rows {[request_ids[i] for i in rows]} are due for retrieval; the "
                                       f"salience scorer needs draft_query [B, Hq_d, D] with B = {b}")
            scores = ops.salience_scores(draft_query.to(self.device)[ridx], self._chunk_sum[dslots], root_d,
                                         self.chunk)
        summaries = None
        if self._chunk_sum is not None and self.spec.context.redundancy_weight > 0:
            summaries = self._chunk_sum[dslots]
            nc = scores.shape[1]
            if summaries.shape[1] < nc:  # the scoring K cache is longer than the store: no keys past max_len
                summaries = torch.nn.functional.pad(summaries, (0, 0, 0, 0, 0, nc - summaries.shape[1]))
            summaries = summaries[:, :nc]
        anchors = ops.select_chunks(scores, root_d, self.chunk, self.max_chunks, self.spec.context.keep_sink_chunk,
                                    self.spec.context.redundancy_weight, summaries)
        self._anchors[dslots] = anchors
        host = anchors.cpu().numpy()
        ms = (time.perf_counter() - t0) * 1e3 / len(rows)
        for j, i in enumerate(rows):
            self._ctl.record(slots[i], host[j], roots[i], ms, after_prefill)

    def _attention_scores(self, what, b, ridx, root_d, query, lse, keys) -> torch.Tensor:
        if not isinstance(query, torch.Tensor) or keys is None:
            raise BridgeInputError(f"{what}: a row is due for retrieval but query ([B, Hq, D]) and keys (the scoring "
                                   f"layer's K cache) were not given")
        if query.dim() != 3 or query.shape[0] != b:
            raise BridgeInputError(f"{what}: query must be [B, Hq, D] with B = {b}, got {tuple(query.shape)}")
        if lse is not None and (lse.dim() != 2 or tuple(lse.shape) != tuple(query.shape[:2])):
            raise BridgeInputError(f"{what}: lse must be [B, Hq] = {tuple(query.shape[:2])}, got {tuple(lse.shape)}")
        q = query.to(self.device)[ridx]
        ls = None if lse is None else lse.to(self.device)[ridx]
        if isinstance(keys, PagedKeys):
            if keys.block_table.dim() != 2 or keys.block_table.shape[0] != b:
                raise BridgeInputError(f"{what}: block_table must be [B, max_blocks] with B = {b}, got "
                                       f"{tuple(keys.block_table.shape)}")
            table = keys.block_table.to(keys.pool.device)[ridx.to(keys.pool.device)]
            scores = ops.paged_head_sum_scores(q.to(keys.pool.device), None if ls is None else ls.to(keys.pool.device),
                                               keys.pool, table, root_d.to(keys.pool.device), self.chunk)
        elif isinstance(keys, torch.Tensor):
            if keys.dim() != 4 or keys.shape[0] != b:
                raise BridgeInputError(f"{what}: keys must be [B, S, Hkv, D] with B = {b} (batch order) or PagedKeys,"
                                       f" got {tuple(keys.shape)}")
            scores = ops._contiguous_scores(q.to(keys.device), None if ls is None else ls.to(keys.device), keys,
                                            root_d.to(keys.device), self.chunk, tile=ops.SCORE_TILE,
                                            rows=ridx.to(keys.device))
        else:
            raise BridgeInputError(f"{what}: keys must be a tensor [B, S, Hkv, D] or PagedKeys, got "
                                   f"{type(keys).__name__}")
        return (scores / q.shape[1]).to(self.device)

    # ---------------------------------------------------------------------------------------- rebuild
    def rebuild(self, request_ids: Sequence[Hashable], root) -> WorkingCache:
        """Draft step 0: rebuild the working cache of each request for root r (after :meth:`on_commit`).

        History = anchor tokens + rolling window of the most recent other positions ``< r``
        (docs/method.md section 3.2), gathered from the store, keys rotated with the draft's RoPE at local positions
        ``0..n-1``.

        Args:
            request_ids: batch order (B <= max_slots); root: int ``[B]`` r per request.
        Returns:
            :class:`WorkingCache` (batch order).
        Raises:
            BridgeInputError: a root beyond the store capacity, or history positions that were never stored.
        """
        slots = self._slot_list(request_ids, "rebuild")
        roots = self._roots(root, len(slots), "rebuild")
        for rid, s, r in zip(request_ids, slots, roots):
            if self._stored[s] < r:
                raise BridgeInputError(f"rebuild: request {rid!r} has root {r} but positions are stored only up to "
                                       f"{self._stored[s] - 1}; store every committed entry (on_prefill / on_commit) "
                                       f"before rebuilding")
        b = len(slots)
        sl = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        root_t = torch.as_tensor(roots, dtype=torch.int64, device=self.device)
        idx, n, window = ops.history_indices(self._anchors[sl], root_t, self.chunk, self.history_budget)
        wk, wv = self._work_k[:b], self._work_v[:b]
        ops.gather_rope_write(self._store_k, self._store_v, wk, wv, idx, self._cos, self._sin,
                              interleaved=self.rope.interleaved, store_rows=sl)
        self._n[sl] = n
        self._window[sl] = window
        return WorkingCache(k=wk, v=wv, n=n, root_slot=n.to(torch.int64), history=idx, window=window)

    def rotate(self, x: torch.Tensor, local_positions) -> torch.Tensor:
        """Apply the draft's RoPE to ``x [B, T, H, D]`` at int ``[B, T]`` local positions (root q/k at n, chain
        step j at n + j)."""
        pos = ops._as_index(local_positions, x.device, "local_positions")
        cos, sin = ops.rope_cos_sin(pos, self.inv_freq.to(x.device))
        return ops.apply_rope(x, cos, sin, interleaved=self.rope.interleaved)

    # ------------------------------------------------------------------------------------------ status
    def retrieval_status(self) -> dict[str, Any]:
        """``retrieval_status`` counters (docs/method.md section 11).

        Returns:
            ``{"aggregate": ..., "per_request": {request_id: {..., "slot": s}}, "lifetime": ...}``: ``aggregate``
            sums the additive counters over the registered requests (plus ``retrieval_ms``, the mean, and
            ``selection_digest``, a digest of every request's digest in slot order); ``lifetime`` sums the additive
            counters over every request served, released ones included. Both satisfy
            ``cycles = (retrievals - retrievals_after_prefill) + skipped_not_due + skipped_fits``.
        """
        n, window = self._n.tolist(), self._window.tolist()
        per, order = {}, []
        for rid, s in sorted(self._slot_of.items(), key=lambda kv: kv[1]):
            self._ctl.observe(s, working_len=int(n[s]), window=int(window[s]))
            per[rid] = dict(self._ctl.c[s].report(), slot=s)
            order.append(s)
        agg = self._ctl.aggregate(order)
        lifetime = {k: self._lifetime[k] + agg[k] for k in ADDITIVE}
        return {"aggregate": agg, "per_request": per, "lifetime": lifetime}
