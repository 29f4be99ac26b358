"""Orbax checkpoints of params (+ config).

Layout of a directory written by :func:`save_orbax`::

    config.json               the model config in the transformers v5 dialect (readable by ModelConfig)
    diffspec_checkpoint.json  {"format": "orbax", "kind": ..., "dtype": ...}
    params/                   an Orbax StandardCheckpointer tree

Restoring passes the expected tree (shapes from the config, dtypes as saved) to Orbax, so the round trip is
bit exact and a tree that does not match its config is refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from diffspec_jax.errors import CheckpointError

MARKER = "diffspec_checkpoint.json"
PARAMS_DIR = "params"


def is_orbax_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def save_orbax(path: str | Path, config_dict: dict[str, Any], params: Any, *, kind: str = "target") -> Path:
    """Save ``params`` and ``config_dict`` under ``path`` (created; must not hold a previous checkpoint)."""
    path = Path(path).absolute()
    if (path / PARAMS_DIR).exists():
        raise CheckpointError(f"{path / PARAMS_DIR} already exists; choose an empty output directory")
    path.mkdir(parents=True, exist_ok=True)
    dtypes = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(params)})
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    (path / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    (path / MARKER).write_text(json.dumps({"format": "orbax", "kind": kind, "dtypes": dtypes}) + "\n")
    return path


def stored_tree(path: str | Path) -> Any:
    """The params tree as saved (``jax.ShapeDtypeStruct`` leaves on the first device), from Orbax's metadata.

    Raises:
        CheckpointError: not a diffspec Orbax checkpoint, or metadata Orbax cannot read.
    """
    path = Path(path).absolute()
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not an Orbax checkpoint written by diffspec-jax (no {MARKER})")
    if not (path / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{path}: the params directory {PARAMS_DIR}/ is missing")
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # a damaged file is reported once, by the error below, not by Orbax's warnings too
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path / PARAMS_DIR)
        stored_tree = getattr(stored, "item_metadata", stored)
        stored_tree = getattr(stored_tree, "tree", stored_tree)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), stored_tree)
    except Exception as exc:  # orbax raises many types for damaged metadata
        raise CheckpointError(f"{path}: cannot read the Orbax params metadata ({type(exc).__name__}: {exc}); the "
                              f"checkpoint is damaged or incomplete") from exc
    finally:
        absl.setLevel(level)


def load_orbax(path: str | Path, abstract_params: Any | None = None, *,
               before_restore: Callable[[], Any] | None = None) -> Any:
    """Restore params saved by :func:`save_orbax` into the structure of ``abstract_params``.

    Args:
        abstract_params: pytree of ``jax.ShapeDtypeStruct`` (shapes from the config; the dtype the caller wants);
            ``None`` restores the tree as saved.
        before_restore: called once the saved tree is known to match, before any data is read (the integrity
            check of ``load_target``).
    """
    path = Path(path).absolute()
    saved = stored_tree(path)
    if abstract_params is None:
        abstract_params = saved
    _check_structure(path, saved, abstract_params)
    if before_restore is not None:
        before_restore()
    with ocp.StandardCheckpointer() as ckptr:
        try:
            params = ckptr.restore(path / PARAMS_DIR, saved)
        except Exception as exc:  # orbax raises many types for corrupt or mismatched trees
            raise CheckpointError(f"{path}: cannot restore the Orbax params ({type(exc).__name__}: {exc}); the "
                                  f"checkpoint is damaged or incomplete") from exc
    try:
        return jax.tree_util.tree_map(lambda x, a: jnp.asarray(x, a.dtype), params, abstract_params)
    except Exception as exc:
        raise CheckpointError(f"{path}: the restored Orbax params do not match config.json ({exc})") from exc


def _check_structure(path: Path, saved: Any, expected: Any) -> None:
    flat_saved = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    names = lambda d: {jax.tree_util.keystr(k): v for k, v in d.items()}  # noqa: E731
    s, e = names(flat_saved), names(flat_expected)
    if set(s) != set(e):
        diff = sorted(set(s) ^ set(e))[:5]
        raise CheckpointError(f"{path}: params tree does not match config.json (differing leaves {diff}); if "
                              f"config.json is right, the Orbax metadata in {PARAMS_DIR}/ is damaged")
    for k in e:
        if tuple(s[k].shape) != tuple(e[k].shape):
            raise CheckpointError(f"{path}: params leaf {k} has shape {list(s[k].shape)}, config.json implies "
                                  f"{list(e[k].shape)}")
