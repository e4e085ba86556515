"""The owner side: turn this rank's items of a batch into model inputs, by IndexMap."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, final

import numpy as np
import torch
from mmwire.kernels import KERNEL_PROCESSORS, Region
from mmwire.transport import (
    EncodedImage,
    FeatureEnvelope,
    GlobalIndex,
    GlobalTable,
    IndexMap,
    LocalIndex,
    LocalSlots,
    PreprocessSpec,
)
from mmwire.transport.errors import ConfigurationError, GridMismatch, MaterializeError
from mmwire.transport.images import MAX_IMAGE_PIXELS, to_pixels
from mmwire.transport.wire import CpuRef, InlineRef

from ._cache import CacheKey, CacheStatistics, OutputCache, output_key
from ._compute import resolve_compute
from ._decode import check_encoded, decode_encoded
from ._families import ModelSpec
from ._gpu_decode import decode_jpegs_on_gpu, gpu_decodable, require_gpu_decoder
from ._pipeline import produce
from ._plan import expected_plan
from ._regions import regions_of, tiled
from ._video_owner import VideoItem, check_video, decoded_bytes, video_rows

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

    ``pixel_values`` holds the images' (raw and processed items') patches concatenated in
    local order (allocated once) and ``grid_thw`` their grids; raw and encoded videos go to
    ``pixel_values_videos`` and ``video_grid_thw``, as transformers' processors return
    them. ``features[LocalIndex(k)]`` is slot k's rows of either (a view, on its device),
    or its embedding tensor (passed through, not copied: a CPU view of the payload).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    features: LocalSlots[torch.Tensor]
    index_map: IndexMap
    pixel_values_videos: torch.Tensor | None = None
    """The videos' rows ``(n, 3·T·p·p)`` in local order (``None`` without videos); a video
    slot's ``features`` are its rows of it."""
    video_grid_thw: torch.Tensor | None = None
    """The videos' grids ``(t, h, w)``, in local order."""


@final
class Materializer:
    """Materialises the items one rank owns.

    Args:
        rank: this rank; ``materialize`` refuses an ``IndexMap`` of another rank.
        device: where the outputs go.
        dtype: output dtype of ``pixel_values`` (fp32, bf16, fp16).
        compute: ``"cpu"`` computes with Pillow on the host (and uploads the result to a
            CUDA ``device``); ``"cuda"`` uploads each raw item's uint8 pixels once and runs
            the ``mmwire.kernels`` pipeline there; ``"auto"`` (default) is ``"cuda"`` for a
            CUDA device when CuPy is installed, else ``"cpu"``. Both give the same bytes. A
            batch with a family the kernels do not run yet (Gemma 3, InternVL) is computed
            on the host and uploaded.
        max_pixels: ceiling on a raw or encoded item's ``W·H``, a video's frames'
            included (default ``MAX_IMAGE_PIXELS``, 40 MP), checked from its header before
            it is decoded.
        max_output_bytes: ceiling on one batch's ``pixel_values``, checked before anything
            is allocated (default 4 GiB).
        decode_threads: threads that decode a batch's encoded items in parallel.
        max_decoded_bytes: ceiling on the pixels one batch's encoded items and videos'
            sampled frames decode to (each header is read and checked against its envelope
            first; default 1 GiB).
        preprocess: the families' specs this rank serves (``spec_for(...)``): on ``"cuda"``
            their kernels compile here, up front, rather than at their first batch
            (Kimi-K2.5's always do).
        gpu_decode: on ``"cuda"``, decode encoded RGB and grayscale JPEGs on the GPU
            (torchvision's nvJPEG). **Approximate**: nvJPEG's chroma upsampling and IDCT
            rounding differ from Pillow's, so their outputs are not the checkpoint
            processor's bytes; off by default, and never chosen otherwise. Other formats
            still decode with Pillow.
        cache_bytes: a budget for keeping raw and encoded items' outputs on ``device``
            (0: no cache). An item whose payload bytes, spec and dtype were materialised
            before is copied from the cache instead of decoded, uploaded and run through
            the kernels; the key is recomputed from the bytes this rank received (BLAKE3,
            about 13 ms for 36 MB of pixels on two cores), never taken from the envelope.

    ``pixel_values`` has the rows of the batch's family: ``(n, 3, p, p)`` for Kimi,
    ``(n, 3·T·p·p)`` for Qwen-VL; a batch whose items' rows differ is refused.

    The owner trusts nothing in an envelope it can recompute: a raw item's plan must be the
    one its size gets under its spec's limits (``GridMismatch`` otherwise), so what one
    envelope can make this rank do is bounded by its own pixels and its checkpoint's limits.

    A failing item raises a ``MaterializeError`` (or ``GridMismatch``) naming it; nothing is
    left half-done and the materializer keeps serving the next batch.
    """

    def __init__(
        self,
        rank: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        compute: Literal["auto", "cpu", "cuda"] = "auto",
        max_pixels: int = MAX_IMAGE_PIXELS,
        max_output_bytes: int = 4 << 30,
        preprocess: Sequence[ModelSpec] = (),
        decode_threads: int = 4,
        max_decoded_bytes: int = 1 << 30,
        cache_bytes: int = 0,
        gpu_decode: bool = False,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_pixels = max_pixels
        self.max_output_bytes = max_output_bytes
        self.decode_threads = decode_threads
        self.max_decoded_bytes = max_decoded_bytes
        self._decode_pool: ThreadPoolExecutor | None = None
        self._cache = OutputCache(cache_bytes) if cache_bytes > 0 else None
        self.compute: Literal["cpu", "cuda"] = resolve_compute(compute, self.device)
        self.gpu_decode = gpu_decode
        if gpu_decode:
            if self.compute != "cuda":
                raise ConfigurationError('`gpu_decode=True` needs `compute="cuda"`')
            require_gpu_decoder()
        if self.compute == "cuda":
            from mmwire.kernels import CupyLauncher, output_layout, region_layout, region_patch

            self._launcher = CupyLauncher(self.device)  # compiles the kernels once, up front
            for spec in (m(64, 64) for m in preprocess):
                if spec.processor not in KERNEL_PROCESSORS:  # computed on the host
                    continue
                if tiled(spec):
                    tile = spec.row_shape[1:]
                    self._launcher.compile(region_patch(tile), region_layout(tile))
                else:
                    self._launcher.compile(spec.patch_size, output_layout(spec))

    def materialize(self, batch: PayloadSource, index_map: IndexMap) -> MaterializedBatch:
        """Model inputs for the items ``index_map`` gives this rank, in its local order."""
        if index_map.rank != self.rank:
            raise MaterializeError(
                f"IndexMap is for rank {index_map.rank}, this is rank {self.rank}"
            )
        envs = [(local, g, batch.envelopes[g]) for local, g in index_map.items()]
        processors = {e.preprocess.processor for _, _, e in envs if e.preprocess is not None}
        if len(processors) > 1:  # rows of one shape may still be two families' (Gemma, InternVL)
            raise MaterializeError(
                f"items of one batch follow different processors {sorted(processors)}: one "
                "family a batch"
            )
        shapes = {_row_shape(e) for _, _, e in envs if e.kind != "embedding" and e.video is None}
        if len(shapes) > 1:
            raise MaterializeError(
                f"items of one batch have rows of different shapes {sorted(shapes)} "
                "(different patch sizes or families)"
            )
        row_shape = shapes.pop() if shapes else (3, 14, 14)
        walk = self._walk(batch, envs, row_shape)
        out_bytes = walk.rows * math.prod(row_shape) * self.dtype.itemsize
        out_bytes += sum(
            v.rows * math.prod(v.config.row_shape) * self.dtype.itemsize for v in walk.videos
        )
        if out_bytes > self.max_output_bytes:
            raise MaterializeError(
                f"rank {self.rank}'s items of this batch need {walk.rows} patches "
                f"({out_bytes} bytes of {self.dtype}), over `max_output_bytes` "
                f"{self.max_output_bytes}"
            )
        self._check_decoded_bytes(walk.raw, decoded_bytes(walk.videos))
        on_kernels = all(item.spec.processor in KERNEL_PROCESSORS for item in walk.raw)
        if self.compute == "cuda" and on_kernels:
            out = self._on_cuda(batch, index_map, walk, row_shape)
            return self._kept(walk, self._with_videos(batch, walk, out))
        pixel_values = torch.empty((walk.rows, *row_shape), dtype=self.dtype)
        decoded = self._decode_all(batch, walk.raw, pinned=False)
        for item, pixels in zip(walk.raw, decoded):
            if pixels is None:
                pixels = self._pixels(batch, item)
            produce(pixels, item.spec, pixel_values[item.row : item.row + item.rows])
        for src, row, n in walk.processed:
            pixel_values[row : row + n].copy_(src)
        grid_thw = torch.tensor(walk.grids, dtype=torch.int64).reshape(-1, 3)
        if self.device.type != "cpu":
            pixel_values = pixel_values.to(self.device)
            grid_thw = grid_thw.to(self.device)
        out = walk.finish(pixel_values, grid_thw, index_map)
        return self._kept(walk, self._with_videos(batch, walk, out))

    def _with_videos(
        self, batch: PayloadSource, walk: _Walk, out: MaterializedBatch
    ) -> MaterializedBatch:
        """``out`` with the batch's videos' rows: by the CUDA kernels on ``"cuda"``, else
        the reference's own torch operations on the host, moved to ``device``."""
        if not walk.videos:
            return out
        payloads = [
            batch.open(v.index) if v.spec.header is not None else batch.open_tensor(v.index)
            for v in walk.videos
        ]
        kernels = self.compute == "cuda"
        rows, grids = video_rows(payloads, walk.videos, self.dtype, self.device, kernels)
        at = 0
        for v in walk.videos:
            out.features[v.local] = rows[at : at + v.rows]
            at += v.rows
        return dataclasses.replace(out, pixel_values_videos=rows, video_grid_thw=grids)

    def _kept(self, walk: _Walk, out: MaterializedBatch) -> MaterializedBatch:
        """``out``, after the cache kept a copy of each missed item's rows."""
        if self._cache is not None:
            for item in walk.raw:
                if item.key is not None:
                    self._cache.put(item.key, out.pixel_values[item.row : item.row + item.rows])
        return out

    def cache_statistics(self) -> CacheStatistics | None:
        """The output cache's use, or ``None`` without one (``cache_bytes=0``)."""
        return None if self._cache is None else self._cache.statistics()

    def _walk(
        self,
        batch: PayloadSource,
        envs: list[tuple[LocalIndex, GlobalIndex, FeatureEnvelope]],
        row_shape: tuple[int, ...],
    ) -> _Walk:
        """Every item checked and placed: embeddings passed through, rows of the others."""
        walk = _Walk(LocalSlots(len(envs)))
        for local, g, env in envs:
            where = f"item {g.value} (local slot {local.value}) of request {env.request_id!r}"
            if env.kind == "embedding":
                walk.features[local] = batch.open_tensor(g)
                continue
            if env.video is not None:
                walk.videos.append(check_video(env, local, g, where, self.max_pixels))
                continue
            n = _rows(env)
            if env.kind in ("raw", "encoded"):
                spec = self._raw_spec(env, where)
                if self._cache is not None and isinstance(env.payload, (CpuRef, InlineRef)):
                    key = output_key(batch.open(g), spec, self.dtype)
                    rows = self._cache.get(key)
                    if rows is not None:  # made before from the same bytes: copied, not run
                        walk.processed.append((rows, walk.rows, n))
                    else:
                        walk.raw.append(_RawItem(g, spec, walk.rows, n, where, env.encoding, key))
                else:
                    walk.raw.append(_RawItem(g, spec, walk.rows, n, where, env.encoding))
            else:
                walk.processed.append((_processed(batch, g, where, row_shape), walk.rows, n))
            walk.grids.append(env.grid.thw)
            walk.spans.append((local, walk.rows, n))
            walk.rows += n
        return walk

    def _on_cuda(
        self,
        batch: PayloadSource,
        index_map: IndexMap,
        walk: _Walk,
        row_shape: tuple[int, ...],
    ) -> MaterializedBatch:
        """Upload raw pixels once into one packed buffer, then two kernel launches.

        Everything is checked before the first upload. Returns once the uploads are done
        (the payload views may then be released); the kernels run on the current torch
        stream, which orders any later use of the outputs after them.
        """
        from mmwire.kernels import preprocess_packed, preprocess_regions, to_device

        on_gpu = self._decode_on_gpu(batch, walk.raw) if self.gpu_decode else {}
        decoded = self._decode_all(batch, walk.raw, pinned=True, skip=on_gpu.keys())
        views = []  # each item's uint8 pixels: on the GPU, decoded on the host, or in the arena
        for k, (item, pixels) in enumerate(zip(walk.raw, decoded)):
            if k in on_gpu:
                views.append(on_gpu[k])
            elif pixels is not None:
                views.append(torch.from_numpy(pixels))
            else:
                views.append(batch.open_tensor(item.index))
        pixel_values = torch.empty((walk.rows, *row_shape), dtype=self.dtype, device=self.device)
        packed = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        at = 0
        for view in views:  # one upload per item, straight from the (registered) arena
            packed[at : at + view.numel()].copy_(view.reshape(-1), non_blocking=True)
            at += view.numel()
        for src, row, n in walk.processed:
            pixel_values[row : row + n].copy_(src, non_blocking=True)
        uploaded = torch.cuda.Event()  # type: ignore[no-untyped-call]
        uploaded.record(stream)
        try:
            shapes = [(int(v.shape[0]), int(v.shape[1]), int(v.shape[2])) for v in views]
            specs = [item.spec for item in walk.raw]
            rows = [item.row for item in walk.raw]
            if views and tiled(specs[0]):  # one family a batch
                regions = [self._regions(item) for item in walk.raw]
                preprocess_regions(
                    packed, shapes, specs, regions, pixel_values, rows=rows, launcher=self._launcher
                )
            elif views:
                preprocess_packed(
                    packed,
                    shapes,
                    specs,
                    self.dtype,
                    out=pixel_values,
                    rows=rows,
                    launcher=self._launcher,
                )
        finally:
            uploaded.synchronize()  # the host views must outlive the copies from them
        return walk.finish(pixel_values, to_device(walk.grids, self.device), index_map)

    @staticmethod
    def _regions(item: _RawItem) -> list[Region]:
        try:
            return regions_of(item.spec)
        except MaterializeError as e:
            raise MaterializeError(f"{item.where}: {e}") from e

    def _raw_spec(self, env: FeatureEnvelope, where: str) -> PreprocessSpec:
        """A raw item's spec after the checks the CPU path makes while producing it."""
        spec = env.preprocess
        if spec is None:
            raise MaterializeError(f"raw {where} has no preprocess spec")
        if env.encoding is not None:
            h, w = env.encoding.height, env.encoding.width
        else:
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
        if (w, h) != (spec.plan.width, spec.plan.height):
            raise GridMismatch(f"raw {where} is {w}x{h}, its plan is for another size")
        try:
            expected = expected_plan(spec)
        except ValueError as e:
            raise MaterializeError(f"raw {where}: {e}") from e
        if spec.plan != expected:
            raise GridMismatch(
                f"raw {where}: its plan (resize to {spec.plan.new_width}x"
                f"{spec.plan.new_height}, pad {spec.plan.pad_width}x{spec.plan.pad_height}, "
                f"{spec.plan.tokens} tokens) is not the one a {w}x{h} image gets under its "
                f"spec's limits ({expected.new_width}x{expected.new_height}, pad "
                f"{expected.pad_width}x{expected.pad_height}, {expected.tokens} tokens)"
            )
        return spec

    def _pixels(self, batch: PayloadSource, item: _RawItem) -> np.ndarray[Any, Any]:
        """A raw item's pixels, read from its payload."""
        try:
            return to_pixels(batch.open(item.index), max_pixels=self.max_pixels)
        except MaterializeError as e:
            raise MaterializeError(f"{item.where}: {e}") from e

    def _decode_on_gpu(
        self, batch: PayloadSource, items: list[_RawItem]
    ) -> dict[int, torch.Tensor]:
        """The pixels of the items the GPU decodes (``gpu_decode``), by position in ``items``,
        each header checked against its envelope first."""
        self._check_decoded_bytes(items)
        picked: list[tuple[int, memoryview, EncodedImage]] = []
        for k, item in enumerate(items):
            if item.encoding is None or item.encoding.format != "JPEG":
                continue
            raw = check_encoded(
                batch.open(item.index),
                item.encoding,
                item.spec.alpha,
                item.where,
                max_pixels=self.max_pixels,
            )
            if gpu_decodable(raw, item.encoding):
                picked.append((k, raw, item.encoding))
        if not picked:
            return {}
        pixels = decode_jpegs_on_gpu(
            [raw for _, raw, _ in picked],
            [e for _, _, e in picked],
            [items[k].where for k, _, _ in picked],
            self.device,
        )
        return {k: p for (k, _, _), p in zip(picked, pixels) if p is not None}

    def _decode_all(
        self,
        batch: PayloadSource,
        items: list[_RawItem],
        pinned: bool,
        skip: Collection[int] = (),
    ) -> list[np.ndarray[Any, Any] | None]:
        """The encoded items' pixels (``None`` for raw ones and positions in ``skip``),
        decoded in parallel: into one pinned host buffer where ``pinned`` (the CUDA path
        uploads from it). Every header is checked against its envelope before anything is
        allocated (the batch's total was checked against ``max_decoded_bytes`` before)."""
        checked = [
            None
            if item.encoding is None or k in skip
            else check_encoded(
                batch.open(item.index),
                item.encoding,
                item.spec.alpha,
                item.where,
                max_pixels=self.max_pixels,
            )
            for k, item in enumerate(items)
        ]
        shapes = [None if raw is None else item.shape for item, raw in zip(items, checked)]
        total = sum(math.prod(s) for s in shapes if s is not None)
        if total == 0:
            return [None] * len(items)
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned).numpy()
        outs: list[np.ndarray[Any, Any] | None] = []
        at = 0
        for shape in shapes:
            if shape is None:
                outs.append(None)
                continue
            outs.append(buffer[at : at + math.prod(shape)].reshape(shape))
            at += math.prod(shape)
        jobs = [
            (item, raw, out)
            for item, raw, out in zip(items, checked, outs)
            if raw is not None and out is not None
        ]

        def decode(job: tuple[_RawItem, memoryview, np.ndarray[Any, Any]]) -> None:
            item, raw, out = job
            decode_encoded(raw, item.spec.alpha, out, item.where, max_pixels=self.max_pixels)

        if len(jobs) > 1:
            list(self._decoders().map(decode, jobs))
        else:
            decode(jobs[0])
        return outs

    def _check_decoded_bytes(self, items: list[_RawItem], videos: int = 0) -> None:
        """``MaterializeError`` if the batch's encoded items (and ``videos`` bytes of sampled
        video frames) decode to more than ``max_decoded_bytes`` (from their checked headers,
        before any decode)."""
        total = videos + sum(math.prod(item.shape) for item in items if item.shape is not None)
        if total > self.max_decoded_bytes:
            raise MaterializeError(
                f"rank {self.rank}'s encoded items and videos of this batch decode to {total} "
                "bytes, over "
                f"`max_decoded_bytes` {self.max_decoded_bytes}"
            )

    def _decoders(self) -> ThreadPoolExecutor:
        """The threads that decode a batch's encoded items in parallel (made at first use;
        Pillow lets go of the GIL while it decodes)."""
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(
                self.decode_threads, thread_name_prefix="mmwire-owner-decode"
            )
        return self._decode_pool


@dataclass(frozen=True)
class _RawItem:
    """A raw or encoded item of this rank's, checked: where its rows go."""

    index: GlobalIndex
    spec: PreprocessSpec
    row: int
    rows: int
    where: str
    encoding: EncodedImage | None
    """An encoded item's header (its payload is the compressed bytes)."""
    key: CacheKey | None = None
    """Where the output cache keeps its rows once made."""

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """The decoded pixels' ``(H, W, C)`` of an encoded item."""
        e = self.encoding
        return None if e is None else (e.height, e.width, e.channels)


@dataclass
class _Walk:
    """A batch's items for this rank, checked: where each non-embedding's rows go."""

    features: LocalSlots[torch.Tensor]
    raw: list[_RawItem] = field(default_factory=list)
    """The raw and encoded items."""
    processed: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    videos: list[VideoItem] = field(default_factory=list)
    """The raw and encoded videos, checked."""
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    spans: list[tuple[LocalIndex, int, int]] = field(default_factory=list)
    rows: int = 0

    def finish(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, index_map: IndexMap
    ) -> MaterializedBatch:
        """The batch, each slot's features a view of ``pixel_values`` on its device."""
        for local, row, n in self.spans:
            self.features[local] = pixel_values[row : row + n]
        return MaterializedBatch(pixel_values, grid_thw, self.features, index_map)


def _processed(
    batch: PayloadSource, g: GlobalIndex, where: str, row: tuple[int, ...]
) -> torch.Tensor:
    """A processed item's ``(n, *row)`` payload view, or a ``MaterializeError``."""
    src = batch.open_tensor(g)
    if tuple(src.shape[1:]) != row:
        raise MaterializeError(
            f"processed {where} has shape {list(src.shape)}, expected rows of {list(row)}"
        )
    return src


def _row_shape(env: FeatureEnvelope) -> tuple[int, ...]:
    """The rows a raw (its spec's) or processed (its tensor's) item fills."""
    if env.preprocess is not None:
        return env.preprocess.row_shape
    return tuple(int(d) for d in env.tensor.shape[1:])


def _rows(env: FeatureEnvelope) -> int:
    """Rows of ``pixel_values`` a raw or processed item fills."""
    if env.kind in ("raw", "encoded") and env.preprocess is not None:
        return env.preprocess.plan.grid.patches
    return int(env.tensor.shape[0])
