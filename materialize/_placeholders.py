"""Placeholder expansion in the array domain, and the K3 media framing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mmwire.transport.errors import MaterializeError

__all__ = ["expand_placeholders", "k3_media_prompt"]


def expand_placeholders(
    input_ids: Sequence[int] | np.ndarray,
    placeholder_id: int,
    token_counts: Sequence[int],
) -> np.ndarray:
    """Repeat each image placeholder to its image's token count (no re-tokenising).

    ``[1, 7, 2, 7, 3]``, placeholder 7, counts ``[3, 2]`` -> ``[1, 7, 7, 7, 2, 7, 7, 3]``.
    Raises ``MaterializeError`` when the number of placeholders is not the number of images.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    positions = np.flatnonzero(ids == placeholder_id)
    if len(positions) != len(token_counts):
        raise MaterializeError(
            f"prompt has {len(positions)} placeholders `{placeholder_id}` but "
            f"{len(token_counts)} images"
        )
    repeats = np.ones(len(ids), dtype=np.int64)
    counts = np.asarray(token_counts, dtype=np.int64)
    if (counts <= 0).any():
        raise MaterializeError(f"token counts must be positive, got {list(token_counts)}")
    repeats[positions] = counts
    return np.repeat(ids, repeats)


def k3_media_prompt(width: int, height: int, tokens: int, pad: str = "<|media_pad|>") -> str:
    """K3's framing of one image: original upload size, then ``tokens`` pads."""
    return f"<|media_begin|>image {width}x{height}<|media_content|>{pad * tokens}<|media_end|>"
