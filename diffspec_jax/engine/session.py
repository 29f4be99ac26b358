"""The runtime object: a :class:`Session` owns what decoding keeps between calls, so nothing of it lives in module
state.

* compiled programs: the jitted steps of each :class:`~diffspec_jax.engine.state.Plan`
  (:func:`~diffspec_jax.engine.compile.build_programs`; per plan and parameter layout) and the server's slot
  programs (:func:`~diffspec_jax.engine.slots.slot_programs`), least recently used first out;
* prepared parameters: each model's params in tensor-parallel layout on a mesh (:func:`diffspec_jax.sharding.prepare`),
  per (model, mesh, tp), dropped with the model;
* the kernel choice is part of each plan (``Plan.kernels``, from :attr:`diffspec_jax.SpecConfig.kernels`), and
  every program is traced under it (:func:`~diffspec_jax.engine.compile.bind`), so one session serves plans with
  different choices side by side.

:func:`diffspec_jax.generate` and the server's :class:`~diffspec_jax.serving.scheduler.SlotEngine` take a
``session``; without one they share :func:`default_session`, which is what keeps repeated ``generate()`` calls
from compiling again. A separate session (``Session()``) starts empty and compiles its own programs.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from jax.sharding import Mesh

from diffspec_jax import sharding
from diffspec_jax.engine.compile import build_programs
from diffspec_jax.engine.slots import slot_programs
from diffspec_jax.engine.state import Plan

#: plans whose programs a session keeps (the least recently used are dropped, their executables with them)
MAX_PLANS = 64
#: plans whose slot programs a session keeps
MAX_SLOT_PLANS = 16


class Session:
    """Compiled programs and prepared parameters, kept between calls (see the module docstring).

    Args:
        max_plans: plans whose programs are kept; max_slot_plans: plans whose slot programs are kept.
    """

    def __init__(self, max_plans: int = MAX_PLANS, max_slot_plans: int = MAX_SLOT_PLANS):
        self.max_plans, self.max_slot_plans = max_plans, max_slot_plans
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._slot_programs: collections.OrderedDict = collections.OrderedDict()
        self._prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # the server's engine thread and callers of generate() may share one

    def _get(self, table: collections.OrderedDict, key, build: Callable[[], Any], limit: int):
        with self._lock:
            if key in table:
                table.move_to_end(key)
                return table[key]
        value = build()
        with self._lock:
            value = table.setdefault(key, value)
            while len(table) > limit:
                table.popitem(last=False)
        return value

    def programs(self, plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
        """The jitted steps of ``plan`` (:func:`~diffspec_jax.engine.compile.build_programs`), built once."""
        return self._get(self._programs, (plan, tspec_key, dspec_key),
                         lambda: build_programs(plan, tspec_key, dspec_key), self.max_plans)

    def slot_programs(self, plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
        """The slot programs of ``plan`` (:func:`~diffspec_jax.engine.slots.slot_programs`), built once."""
        return self._get(self._slot_programs, (plan, tspec_key, dspec_key),
                         lambda: slot_programs(plan, tspec_key, dspec_key), self.max_slot_plans)

    def prepare(self, model, mesh: Mesh, tp: int) -> dict:
        """``model``'s params in tensor-parallel layout over ``tp`` shards on ``mesh``, laid out once per (model,
        mesh, tp): later calls return the same arrays."""
        with self._lock:
            per_model = self._prepared.setdefault(model, {})
        if (mesh, tp) not in per_model:
            per_model.setdefault((mesh, tp), sharding.prepare(model, mesh, tp))
        return per_model[(mesh, tp)]

    def prepare_params(self, target, draft, mesh: Mesh | None, draft_tp: int = 1):
        """``(target params, draft params or None)`` as a plan needs them: unchanged without a mesh, else
        :meth:`prepare`-d (the draft over ``draft_tp`` shards)."""
        if mesh is None:
            return target.params, draft.params if draft is not None else None
        tparams = self.prepare(target, mesh, sharding.mesh_size(mesh, sharding.TP))
        return tparams, self.prepare(draft, mesh, draft_tp) if draft is not None else None


@functools.cache
def default_session() -> Session:
    """The session :func:`diffspec_jax.generate` and the server use when given none (created on first use)."""
    return Session()


def compiled(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """``default_session().programs(plan, ...)``: the jitted steps of ``plan`` as :func:`generate` uses them."""
    return default_session().programs(plan, tspec_key, dspec_key)
