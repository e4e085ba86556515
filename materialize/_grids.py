"""Grid and token arithmetic, and slicing a concatenated encoder output back per item."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mmwire.transport import Grid

__all__ = ["patches_per_item", "split_by_tokens", "tokens_per_item"]


def _grids(grids: Sequence[Grid | Sequence[int]]) -> list[Grid]:
    return [g if isinstance(g, Grid) else Grid.of(g) for g in grids]


def patches_per_item(grids: Sequence[Grid | Sequence[int]]) -> list[int]:
    """Patches of each item: ``t·h·w`` (``h·w`` for 2-D grids)."""
    return [g.patches for g in _grids(grids)]


def tokens_per_item(
    grids: Sequence[Grid | Sequence[int]], merge_kernel: tuple[int, int] = (2, 2)
) -> list[int]:
    """LLM tokens of each item: ``(h·w) // (mh·mw)`` (the temporal axis is pooled away)."""
    return [g.tokens(merge_kernel) for g in _grids(grids)]


def split_by_tokens(
    output: torch.Tensor,
    grids: Sequence[Grid | Sequence[int]],
    merge_kernel: tuple[int, int] = (2, 2),
) -> list[torch.Tensor]:
    """Slice an encoder output ``(Σ tokens, ...)`` back into per-item views, in order."""
    counts = tokens_per_item(grids, merge_kernel)
    if sum(counts) != output.shape[0]:
        raise ValueError(
            f"encoder output has {output.shape[0]} rows, the grids need {sum(counts)} tokens"
        )
    return list(torch.split(output, counts, dim=0))
