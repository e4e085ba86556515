"""The few CUDA driver calls the GPU backends need, through cuda-bindings, checked.

CuPy and torch cover allocation and kernels but not IPC handles, VMM sharing or stream
memory operations; cuda-bindings (NVIDIA's own binding) does. Every call goes through
:func:`call`, which turns a failing ``CUresult`` into ``BackendUnavailable`` naming the
call and the driver's error name.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .errors import BackendUnavailable

__all__ = ["DeviceBytes", "call", "context_for", "driver", "tensor_at"]


@lru_cache(maxsize=1)
def driver() -> Any:
    """``cuda.bindings.driver`` (cuda-bindings >= 12.6), initialised once."""
    try:
        from cuda.bindings import driver as drv
    except ImportError as e:
        raise BackendUnavailable(
            "the GPU backends need cuda-bindings: install mmwire[cuda12] or mmwire[cuda13]"
        ) from e
    (err,) = drv.cuInit(0)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"cuInit failed: {_name(drv, err)}")
    return drv


def _name(drv: Any, err: Any) -> str:
    ok, name = drv.cuGetErrorName(err)
    if ok == drv.CUresult.CUDA_SUCCESS and name:
        return name.decode() if isinstance(name, bytes) else str(name)
    return str(err)


def call(fn: str, *args: Any) -> Any:
    """``driver().<fn>(*args)``: the value(s) after the ``CUresult``, or ``BackendUnavailable``."""
    drv = driver()
    result = getattr(drv, fn)(*args)
    err, rest = result[0], result[1:]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"{fn} failed: {_name(drv, err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def context_for(device: torch.device) -> int:
    """Make ``device``'s primary context (torch's) current on this thread; its ordinal."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(0, device=torch.device("cuda", index))  # torch creates the primary context
    ctx = call("cuDevicePrimaryCtxRetain", call("cuDeviceGet", index))
    call("cuCtxSetCurrent", ctx)
    call("cuDevicePrimaryCtxRelease", call("cuDeviceGet", index))  # torch holds it
    return index


class DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as a ``__cuda_array_interface__`` (uint8).

    ``owner`` is kept alive as long as any tensor made from this object is.
    """

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,  # no stream: ordering is the caller's, by stream memory operations
        }


def tensor_at(
    ptr: int,
    nbytes: int,
    owner: object,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """A zero-copy torch tensor over device memory owned by ``owner``."""
    import torch

    raw = torch.as_tensor(DeviceBytes(ptr, nbytes, owner), device=device)
    return raw.view(dtype).reshape(shape)
