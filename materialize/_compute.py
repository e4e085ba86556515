"""Where a rank computes its pixels: the exact CPU pipeline or the CUDA kernels."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["resolve_compute"]


def resolve_compute(
    compute: Literal["auto", "cpu", "cuda"], device: torch.device
) -> Literal["cpu", "cuda"]:
    """What ``compute="auto"`` stands for on ``device``; refuses ``"cuda"`` off a CUDA device."""
    if compute == "cpu":
        return "cpu"
    if compute == "cuda":
        if device.type != "cuda":
            raise ValueError(f"compute 'cuda' needs a CUDA device, got {device}")
        return "cuda"
    if compute != "auto":
        raise ValueError(f"compute must be 'auto', 'cpu' or 'cuda', got {compute!r}")
    if device.type != "cuda":
        return "cpu"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cpu"
    return "cuda"
