"""Zero-copy numpy/torch views of payload bytes, typed by a :class:`TensorSpec`."""

from __future__ import annotations

import warnings
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from ._schema import TensorSpec

__all__ = ["dtype_name", "numpy_view", "torch_dtype", "torch_view"]

_NUMPY: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "bool",
    )
}

_NAMES = {dtype: name for name, dtype in _NUMPY.items()}


def dtype_name(dtype: np.dtype[Any]) -> str:
    """A numpy dtype's name: a lookup for the whitelisted ones (``dtype.name`` is built
    anew at each call, and costs more than copying 16 KiB)."""
    return _NAMES.get(dtype) or dtype.name


@cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a whitelisted dtype name stands for."""
    import torch

    dtypes: dict[str, torch.dtype] = {
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "bool": torch.bool,
    }
    return dtypes[name]


def numpy_view(spec: TensorSpec, buf: Any, offset: int = 0) -> np.ndarray[Any, Any]:
    """A read-only numpy array over ``spec.nbytes`` bytes of ``buf`` at ``offset``, no copy.

    The array keeps ``buf`` alive; it is only valid while the payload's lease is held.
    ``bfloat16`` has no numpy dtype: use :func:`torch_view` for it.
    """
    dtype = _NUMPY.get(spec.dtype)
    if dtype is None:
        raise TypeError(f"`{spec.dtype}` has no numpy dtype; open it as a torch tensor instead")
    count = spec.nbytes // dtype.itemsize
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(spec.shape)
    arr.flags.writeable = False
    return arr


def torch_view(spec: TensorSpec, buf: Any, offset: int = 0) -> torch.Tensor:
    """A CPU tensor over ``spec.nbytes`` bytes of ``buf`` at ``offset``, no copy.

    torch has no read-only tensors: the memory is shared with the producer (and, for an
    arena, mapped read-only), so writing into the tensor is a caller bug. Copy first if
    the tensor must be modified. Valid only while the payload's lease is held.
    """
    import torch

    global _warned
    dtype = _NUMPY.get(spec.dtype)
    if dtype is not None:  # typed and shaped by numpy, which costs a third of torch's ops
        count = spec.nbytes // dtype.itemsize
        raw = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(spec.shape)
    else:
        raw = np.frombuffer(buf, dtype=np.uint8, count=spec.nbytes, offset=offset)
    if _warned:
        t = torch.from_numpy(raw)
    else:
        # torch warns, once per process, that the buffer is not writable; that is the point
        # of a shared view. Catching warnings costs more than the view, so only once.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
        _warned = True
    if dtype is not None:
        return t
    return t.view(torch_dtype(spec.dtype)).reshape(spec.shape)  # bfloat16: numpy has none


_warned = False
