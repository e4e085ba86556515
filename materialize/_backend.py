"""Which pixel backend runs on a device: the exact CPU pipeline or the CUDA kernels."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["resolve_backend"]


def resolve_backend(
    backend: Literal["auto", "cpu", "cuda"], device: torch.device
) -> Literal["cpu", "cuda"]:
    """The backend ``"auto"`` stands for on ``device``; refuses ``"cuda"`` off a CUDA device."""
    if backend == "cpu":
        return "cpu"
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend 'cuda' needs a CUDA device, got {device}")
        return "cuda"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    if device.type != "cuda":
        return "cpu"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cpu"
    return "cuda"
