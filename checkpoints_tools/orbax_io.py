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
from pathlib import Path
from typing import Any

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


def load_orbax(path: str | Path, abstract_params: Any) -> Any:
    """Restore params saved by :func:`save_orbax` into the structure of ``abstract_params``.

    Args:
        abstract_params: pytree of ``jax.ShapeDtypeStruct`` (shapes from the config; the dtype the caller wants).
    """
    path = Path(path).absolute()
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not an Orbax checkpoint written by diffspec-jax (no {MARKER})")
    if not (path / PARAMS_DIR).exists():
        raise CheckpointError(f"{path}: the params directory {PARAMS_DIR}/ is missing")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = ckptr.metadata(path / PARAMS_DIR)
            stored_tree = getattr(stored, "item_metadata", stored)
            stored_tree = getattr(stored_tree, "tree", stored_tree)
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            saved = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), stored_tree)
            _check_structure(path, saved, abstract_params)
            params = ckptr.restore(path / PARAMS_DIR, saved)
        except CheckpointError:
            raise
        except Exception as exc:  # orbax raises many types for corrupt or mismatched trees
            raise CheckpointError(f"{path}: cannot restore the Orbax params ({type(exc).__name__}: {exc})") from exc
    return jax.tree_util.tree_map(lambda x, a: jnp.asarray(x, a.dtype), params, abstract_params)


def _check_structure(path: Path, saved: Any, expected: Any) -> None:
    flat_saved = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    names = lambda d: {jax.tree_util.keystr(k): v for k, v in d.items()}  # noqa: E731
    s, e = names(flat_saved), names(flat_expected)
    if set(s) != set(e):
        diff = sorted(set(s) ^ set(e))[:5]
        raise CheckpointError(f"{path}: params tree does not match config.json (differing leaves {diff})")
    for k in e:
        if tuple(s[k].shape) != tuple(e[k].shape):
            raise CheckpointError(f"{path}: params leaf {k} has shape {list(s[k].shape)}, config.json implies "
                                  f"{list(e[k].shape)}")
