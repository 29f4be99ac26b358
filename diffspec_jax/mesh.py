"""The ``("dp", "tp")`` device mesh and how KV heads are laid out on its ``tp`` axis.

The lowest layer of the parallel code: the KV caches (:mod:`diffspec_jax.cache`), the parameter tables
(:mod:`diffspec_jax.models.params`) and the sharded parameter layout (:mod:`diffspec_jax.sharding`) build on it.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from diffspec_jax.errors import ConfigError

TP, DP = "tp", "dp"


def make_mesh(tp: int = 1, dp: int = 1, devices: list | None = None) -> Mesh:
    """A ``("dp", "tp")`` mesh over the first ``dp * tp`` devices (Auto axes, so jit reshards inputs as needed).

    Works with CPU virtual devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), one GPU or several;
    with ``jax.distributed.initialize`` the devices of every process are included.
    """
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or dp < 1:
        raise ConfigError(f"mesh sizes must be >= 1, got tp={tp}, dp={dp}")
    if dp * tp > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={dp * tp} set before JAX starts "
                    f"makes that many virtual devices)")
        raise ConfigError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, only {len(devices)} are visible"
                          + hint)
    return Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), (DP, TP))


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def kv_heads_for(num_kv_heads: int, tp: int, what: str) -> int:
    """KV heads after repetition for ``tp`` shards (refusing layouts that cannot be split): when a model has fewer
    KV heads than ``tp``, each is repeated so that every shard holds the one KV head its query heads read."""
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:
        return tp
    raise ConfigError(f"tensor parallelism: {what} has {num_kv_heads} KV heads, which neither divide by tp={tp} nor "
                      f"divide tp")
