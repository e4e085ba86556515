"""The owner side: turn this rank's items of a batch into model inputs, by IndexMap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, final

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
    PreprocessSpec,
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
        device: where the outputs go.
        dtype: output dtype of ``pixel_values`` (fp32, bf16, fp16).
        backend: ``"cpu"`` computes with Pillow on the host (and uploads the result to a
            CUDA ``device``); ``"cuda"`` uploads each raw item's uint8 pixels once and runs
            the ``mmwire.kernels`` pipeline there; ``"auto"`` (default) is ``"cuda"`` for a
            CUDA device when CuPy is installed, else ``"cpu"``. Both give the same bytes.
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
        backend: Literal["auto", "cpu", "cuda"] = "auto",
        max_pixels: int = 178_956_970,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_pixels = max_pixels
        self.backend: Literal["cpu", "cuda"] = resolve_backend(backend, self.device)
        if self.backend == "cuda":
            from mmwire.kernels import CupyLauncher

            self._launcher = CupyLauncher(self.device)  # compiles the kernels once, up front

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
        if self.backend == "cuda":
            return self._on_cuda(batch, index_map, envs, rows, p)
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
                out.copy_(_processed(batch, g, where, p))
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

    def _on_cuda(
        self,
        batch: PayloadSource,
        index_map: IndexMap,
        envs: list[tuple[LocalIndex, GlobalIndex, FeatureEnvelope]],
        rows: list[int],
        p: int,
    ) -> MaterializedBatch:
        """Upload raw pixels once into one packed buffer, then two kernel launches.

        Everything is checked before the first upload. Returns once the uploads are done
        (the payload views may then be released); the kernels run on the current torch
        stream, which orders any later use of the outputs after them.
        """
        from mmwire.kernels import preprocess_packed
        from mmwire.kernels._ops import to_device

        features: LocalSlots[torch.Tensor] = LocalSlots(len(envs))
        raw: list[tuple[torch.Tensor, PreprocessSpec, int]] = []
        processed: list[tuple[torch.Tensor, int, int]] = []
        grids: list[tuple[int, int, int]] = []
        spans: list[tuple[LocalIndex, int, int]] = []
        start = 0
        for (local, g, env), n in zip(envs, rows):
            where = f"item {g.value} (local slot {local.value}) of request {env.request_id!r}"
            if env.kind == "embedding":
                features[local] = batch.open_tensor(g)
                continue
            if env.kind == "raw":
                spec = self._raw_spec(env, where)
                raw.append((batch.open_tensor(g), spec, start))
            else:
                processed.append((_processed(batch, g, where, p), start, n))
            grids.append(env.grid.thw)
            spans.append((local, start, n))
            start += n
        pixel_values = torch.empty((start, 3, p, p), dtype=self.dtype, device=self.device)
        packed = torch.empty(
            sum(v.numel() for v, _, _ in raw), dtype=torch.uint8, device=self.device
        )
        stream = torch.cuda.current_stream(self.device)
        at = 0
        for view, _, _ in raw:  # one upload per item, straight from the (registered) arena
            packed[at : at + view.numel()].copy_(view.reshape(-1), non_blocking=True)
            at += view.numel()
        for src, row, n in processed:
            pixel_values[row : row + n].copy_(src, non_blocking=True)
        uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
        uploaded.record(stream)
        try:
            if raw:
                preprocess_packed(
                    packed,
                    [(int(v.shape[0]), int(v.shape[1]), int(v.shape[2])) for v, _, _ in raw],
                    [spec for _, spec, _ in raw],
                    self.dtype,
                    out=pixel_values,
                    rows=[row for _, _, row in raw],
                    launcher=self._launcher,
                )
        finally:
            uploaded.synchronize()  # the host views must outlive the copies from them
        grid_thw = to_device(grids, self.device)
        for local, row, n in spans:
            features[local] = pixel_values[row : row + n]
        return MaterializedBatch(pixel_values, grid_thw, features, index_map)

    def _raw_spec(self, env: FeatureEnvelope, where: str) -> PreprocessSpec:
        """A raw item's spec after the checks the CPU path makes while producing it."""
        spec = env.preprocess
        if spec is None:
            raise MaterializeError(f"raw {where} has no preprocess spec")
        h, w = env.tensor.shape[0], env.tensor.shape[1]
        if h * w > self.max_pixels:
            raise MaterializeError(
                f"raw {where} is {w}x{h}, over the pixel ceiling {self.max_pixels}"
            )
        if spec.plan.grid.thw != env.grid.thw:  # the canvas always has the plan's grid
            raise GridMismatch(
                f"{where} produces grid {list(spec.plan.grid.thw)} but its envelope declared "
                f"{list(env.grid.thw)}"
            )
        return spec

    def _raw_into(
        self,
        batch: PayloadSource,
        g: GlobalIndex,
        env: FeatureEnvelope,
        out: torch.Tensor,
        where: str,
    ) -> None:
        spec = self._raw_spec(env, where)
        try:
            pixels = to_pixels(batch.open(g), max_pixels=self.max_pixels)
        except MaterializeError as e:
            raise MaterializeError(f"{where}: {e}") from e
        produce(pixels, spec, out)


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


def _processed(batch: PayloadSource, g: GlobalIndex, where: str, p: int) -> torch.Tensor:
    """A processed item's ``(n, 3, p, p)`` payload view, or a ``MaterializeError``."""
    src = batch.open_tensor(g)
    if tuple(src.shape[1:]) != (3, p, p):
        raise MaterializeError(
            f"processed {where} has shape {list(src.shape)}, expected (n, 3, {p}, {p})"
        )
    return src


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
