"""Device and dtype selection, and zero-copy exchange with JAX through DLPack.

Device order: ``npu`` (Ascend, when ``torch_npu`` imports and reports a device), else ``cuda``, else ``cpu``.
JAX is imported lazily, only by :func:`to_jax` / :func:`from_jax`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

import torch

from diffspec_jax.torch_bridge.errors import BridgeError, BridgeInputError

DEVICE_TYPES = ("npu", "cuda", "cpu")

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def npu_available() -> bool:
    """True when ``torch_npu`` imports and ``torch.npu`` reports at least one device.

    A ``torch_npu`` that is installed but fails to import (missing CANN libraries, version mismatch) counts as
    unavailable, with a warning naming the error.
    """
    try:
        if "torch_npu" not in sys.modules:
            importlib.import_module("torch_npu")
    except ImportError:
        return False
    except Exception as err:  # a broken install: say why, fall back
        warnings.warn(f"torch_npu is installed but failed to import ({type(err).__name__}: {err}); "
                      f"not using the NPU", RuntimeWarning, stacklevel=2)
        return False
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    try:
        return bool(npu.is_available()) and int(npu.device_count()) > 0
    except Exception:  # noqa: BLE001  (a driver error means no usable device)
        return False


def device_type() -> str:
    """``"npu"``, ``"cuda"`` or ``"cpu"``: the first backend that is present, in that order."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def select_device(preferred: str | torch.device | None = None) -> torch.device:
    """The torch device the bridge runs on.

    Args:
        preferred: ``None`` (automatic: npu > cuda > cpu), or a device / string such as ``"cpu"``,
            ``"cuda:1"``, ``"npu:0"``, checked to be available.
    Returns:
        ``torch.device`` (index 0 for an automatic accelerator).
    Raises:
        BridgeError: the preferred backend is not available.
    """
    if preferred is None:
        kind = device_type()
        return torch.device("cpu") if kind == "cpu" else torch.device(kind, 0)
    text = str(preferred)
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES:
        raise BridgeError(f"device {text!r} is not supported by the torch bridge (supported: {DEVICE_TYPES})")
    if kind == "npu" and not npu_available():
        raise BridgeError("device 'npu' requested but torch_npu is not importable or reports no Ascend device")
    if kind == "cuda" and not torch.cuda.is_available():
        raise BridgeError("device 'cuda' requested but torch reports no CUDA device")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, int(index) if index else 0)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.bfloat16`` / ``torch.float16`` / ``torch.float32`` from a dtype or its name (``"bf16"``, ...).

    Raises:
        BridgeInputError: any other dtype (the bridge stores K/V in one of these three).
    """
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise BridgeInputError(f"dtype {dtype!r} is not supported (use bfloat16, float16 or float32)")


def to_jax(tensor: torch.Tensor) -> Any:
    """A JAX array viewing ``tensor``'s memory (DLPack; no copy on CPU and CUDA).

    The array aliases the tensor: do not modify the tensor in place while JAX uses the array (JAX assumes its
    arrays are immutable). JAX needs a backend on the same device: an Ascend (``npu``) tensor cannot be
    exchanged (JAX has no NPU backend), move it with ``tensor.cpu()`` first (one copy).

    Raises:
        BridgeInputError: a tensor on a device JAX cannot see, or one that requires grad.
    """
    if tensor.device.type not in ("cpu", "cuda"):
        raise BridgeInputError(f"to_jax: a tensor on {tensor.device} cannot be shared with JAX (DLPack works on "
                               f"cpu and cuda); copy it with tensor.cpu() first")
    if tensor.requires_grad:
        raise BridgeInputError("to_jax: the tensor requires grad; pass tensor.detach()")
    import jax.dlpack

    return jax.dlpack.from_dlpack(tensor)


def from_jax(array: Any) -> torch.Tensor:
    """A torch tensor viewing a JAX array's memory (DLPack; no copy on CPU and CUDA).

    Writing into the tensor changes the JAX array too; never write into an array JAX may still use (or one that
    a jitted function donated).
    """
    return torch.from_dlpack(array)
