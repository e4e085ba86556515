"""The owner side: turn this rank's items of a batch into model inputs, by IndexMap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, final

import numpy as np
import torch
from mmwire.transport import (
    FeatureEnvelope,
    GlobalIndex,
    GlobalTable,
    GridMismatch,
    IndexMap,
    LocalIndex,
    LocalSlots,
)
from mmwire.transport._errors import MaterializeError

from ._pipeline import produce, to_pixels

__all__ = ["MaterializedBatch", "Materializer", "PayloadSource"]


class PayloadSource(Protocol):
    """What the materializer reads: a batch's envelopes and its payloads (``ReceivedBatch``)."""

    @property
    def envelopes(self) -> GlobalTable[FeatureEnvelope]:
        """The batch's envelopes by global position."""
        ...

    def open(self, index: GlobalIndex) -> np.ndarray[Any, Any]:
        """A read-only view of an owned item's payload (uint8 pixels for raw items)."""
        ...

    def open_tensor(self, index: GlobalIndex) -> torch.Tensor:
        """A tensor view of an owned item's payload."""
        ...


@final
@dataclass(frozen=True)
class MaterializedBatch:
    """This rank's model inputs, in local order.

    ``pixel_values`` holds the raw and processed items' patches concatenated in local order
    (allocated once) and ``grid_thw`` their grids; ``features[LocalIndex(k)]`` is slot k's
    rows of ``pixel_values`` (a view, on its device), or its embedding tensor (passed
    through, not copied: a CPU view of the payload).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    features: LocalSlots[torch.Tensor]
    index_map: IndexMap


@final
class Materializer:
    """Materialises the items one rank owns.

    Args:
        rank: this rank; ``materialize`` refuses an ``IndexMap`` of another rank.
        device: where the outputs go (``"cpu"`` here; the CUDA path comes with the kernels).
        dtype: output dtype of ``pixel_values`` (fp32, bf16, fp16).
        max_pixels: ceiling on a raw item's ``W·H``.

    A failing item raises a ``MaterializeError`` (or ``GridMismatch``) naming it; nothing is
    left half-done and the materializer keeps serving the next batch.
    """

    def __init__(
        self,
        rank: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        max_pixels: int = 178_956_970,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_pixels = max_pixels

    def materialize(self, batch: PayloadSource, index_map: IndexMap) -> MaterializedBatch:
        """Model inputs for the items ``index_map`` gives this rank, in its local order."""
        if index_map.rank != self.rank:
            raise MaterializeError(
                f"IndexMap is for rank {index_map.rank}, this is rank {self.rank}"
            )
        envs = [(local, g, batch.envelopes[g]) for local, g in index_map.items()]
        patch = {_patch_size(e) for _, _, e in envs if e.kind != "embedding"}
        if len(patch) > 1:
            raise MaterializeError(f"items of one batch use different patch sizes {sorted(patch)}")
        p = patch.pop() if patch else 14
        rows = [_rows(e) for _, _, e in envs]
        pixel_values = torch.empty((sum(rows), 3, p, p), dtype=self.dtype)
        grids: list[tuple[int, int, int]] = []
        features: LocalSlots[torch.Tensor] = LocalSlots(len(envs))
        spans: list[tuple[LocalIndex, int, int]] = []
        start = 0
        for (local, g, env), n in zip(envs, rows):
            where = f"item {g.value} (local slot {local.value}) of request {env.request_id!r}"
            if env.kind == "embedding":
                features[local] = batch.open_tensor(g)
                continue
            out = pixel_values[start : start + n]
            if env.kind == "raw":
                self._raw_into(batch, g, env, out, where)
            else:
                src = batch.open_tensor(g)
                if tuple(src.shape[1:]) != (3, p, p):
                    raise MaterializeError(
                        f"processed {where} has shape {list(src.shape)}, expected (n, 3, {p}, {p})"
                    )
                out.copy_(src)
            grids.append(env.grid.thw)
            spans.append((local, start, n))
            start += n
        grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
        if self.device.type != "cpu":
            pixel_values = pixel_values.to(self.device)
            grid_thw = grid_thw.to(self.device)
        for local, start, n in spans:  # views of the returned tensor, on its device
            features[local] = pixel_values[start : start + n]
        return MaterializedBatch(pixel_values, grid_thw, features, index_map)

    def _raw_into(
        self,
        batch: PayloadSource,
        g: GlobalIndex,
        env: FeatureEnvelope,
        out: torch.Tensor,
        where: str,
    ) -> None:
        spec = env.preprocess
        if spec is None:
            raise MaterializeError(f"raw {where} has no preprocess spec")
        h, w = env.tensor.shape[0], env.tensor.shape[1]
        if h * w > self.max_pixels:
            raise MaterializeError(
                f"raw {where} is {w}x{h}, over the pixel ceiling {self.max_pixels}"
            )
        try:
            pixels = to_pixels(batch.open(g), max_pixels=self.max_pixels)
        except MaterializeError as e:
            raise MaterializeError(f"{where}: {e}") from e
        produced = produce(pixels, spec, out)
        if produced.thw != env.grid.thw:
            raise GridMismatch(
                f"{where} produced grid {list(produced.thw)} but its envelope declared "
                f"{list(env.grid.thw)}"
            )


def _patch_size(env: FeatureEnvelope) -> int:
    if env.preprocess is not None:
        return env.preprocess.patch_size
    return int(env.tensor.shape[-1])


def _rows(env: FeatureEnvelope) -> int:
    if env.kind == "embedding":
        return 0
    if env.kind == "raw" and env.preprocess is not None:
        return env.preprocess.plan.grid.patches
    return int(env.tensor.shape[0])
