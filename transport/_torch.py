"""torch, loaded when a caller first needs it: a process that moves numpy arrays and encoded
bytes (a frontend, a CPU rank) never imports it, which takes about 3 s on a 2-core machine.

A tensor can only exist once torch is imported, so ``is_tensor`` asks ``sys.modules``
rather than importing it; code that needs torch imports it where it is used.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import torch

__all__ = ["is_cuda_tensor", "is_tensor"]


def is_tensor(x: object) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is a ``torch.Tensor`` (without importing torch)."""
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(x, mod.Tensor)


def is_cuda_tensor(x: object) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is a ``torch.Tensor`` on a CUDA device."""
    return is_tensor(x) and x.is_cuda
