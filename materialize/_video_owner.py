"""The owner's videos: check each video envelope against what the owner can recompute,
decode the sampled frames of the containers, and make ``pixel_values_videos``.

Nothing in a video's envelope is taken on trust where the owner can recompute it. A
container's header is read again from the bytes it received and must equal the envelope's;
the plan must be the one that header gets under the envelope's config (the config itself
bounded by the wire's rules); frames that travel decoded must be the size the plan resizes
from. The batch's sampled frames are counted against the owner's ``max_decoded_bytes`` and
every frame against its ``max_pixels`` before anything is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mmwire.transport import FeatureEnvelope, GlobalIndex, LocalIndex
from mmwire.transport.errors import GridMismatch, MaterializeError
from mmwire.transport.videos import VideoSpec, decode_frames, probe_video

from ._video import QwenVideoConfig, normalisation, video_pixel_values

__all__ = ["VideoItem", "check_video", "decoded_bytes", "video_rows"]


@dataclass(frozen=True)
class VideoItem:
    """A video of this rank's, checked: its spec, its planning config and where it goes."""

    local: LocalIndex
    index: GlobalIndex
    spec: VideoSpec
    config: QwenVideoConfig
    where: str

    @property
    def rows(self) -> int:
        return self.spec.plan.grid.patches


def check_video(
    env: FeatureEnvelope, local: LocalIndex, index: GlobalIndex, where: str, max_pixels: int
) -> VideoItem:
    """A video envelope's spec after the checks that need no payload: its frames within
    ``max_pixels``, and its plan the one its config gives its header (or, for frames that
    travel decoded, the resize its config gives that many frames of that size)."""
    spec = env.video
    if spec is None:
        raise MaterializeError(f"video {where} has no video spec")
    plan = spec.plan
    if plan.width * plan.height > max_pixels:
        raise MaterializeError(
            f"video {where} has frames of {plan.width}x{plan.height}, over the pixel ceiling "
            f"{max_pixels}"
        )
    config = QwenVideoConfig.of(spec.config)
    try:
        if spec.header is not None:
            expected = config.plan(spec.header)
            same = expected == plan
        else:
            size = config.resized(len(plan.indices), plan.height, plan.width)
            same = size == (plan.new_height, plan.new_width)
    except MaterializeError as e:
        raise MaterializeError(f"video {where}: {e}") from e
    if not same:
        raise GridMismatch(
            f"video {where}: its plan ({len(plan.indices)} frames resized to "
            f"{plan.new_width}x{plan.new_height}) is not the one its config gives it"
        )
    return VideoItem(local, index, spec, config, where)


def decoded_bytes(items: list[VideoItem]) -> int:
    """Bytes the videos' sampled frames take decoded (what the owner holds at once)."""
    return sum(item.spec.plan.decoded_bytes for item in items if item.spec.header is not None)


def video_rows(
    payloads: list[np.ndarray[Any, Any] | torch.Tensor],
    items: list[VideoItem],
    dtype: torch.dtype,
    device: torch.device,
    kernels: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values_videos`` (the items' rows in order, allocated once on ``device``) and
    ``video_grid_thw`` of the checked ``items``, from their payloads (a container's bytes
    as an array, sampled frames as a tensor view): by the CUDA ``kernels`` (each video's
    frames uploaded once), or by the reference's own torch operations on the host."""
    shapes = {item.config.row_shape for item in items}
    if len(shapes) > 1:
        raise MaterializeError(
            f"videos of one batch have rows of different shapes {sorted(shapes)}: one family "
            "a batch"
        )
    (row,) = shapes
    rows = sum(item.rows for item in items)
    out = torch.empty((rows, *row), dtype=dtype, device=device if kernels else "cpu")
    at = 0
    for item, payload in zip(items, payloads):
        frames = _frames(payload, item)
        target = out[at : at + item.rows]
        if kernels:
            _on_gpu(frames, item, target)
        else:
            target.copy_(video_pixel_values(frames, item.spec.plan, item.config, dtype))
        at += item.rows
    grids = torch.tensor([item.spec.plan.grid.thw for item in items], dtype=torch.int64)
    return out.to(device), grids.reshape(-1, 3).to(device)


def _on_gpu(frames: torch.Tensor, item: VideoItem, out: torch.Tensor) -> None:
    """One video's rows by the CUDA kernels, into ``out`` on its device."""
    from mmwire.kernels import video_rows as kernel_rows

    plan, config = item.spec.plan, item.config
    mean, std = normalisation(config)
    on_device = frames.contiguous().to(out.device)
    direct = out.dtype in (torch.float32, torch.bfloat16)
    target = out if direct else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    kernel_rows(
        on_device,
        (plan.new_height, plan.new_width),
        patch=config.patch_size,
        merge=config.merge_size,
        temporal=config.temporal_patch_size,
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
        out=target,
    )
    if not direct:  # fp16: float32 rounded once, as the host path does
        out.copy_(target)


def _frames(payload: np.ndarray[Any, Any] | torch.Tensor, item: VideoItem) -> torch.Tensor:
    """The sampled frames of a video, ``(n, H, W, 3)`` uint8: decoded from its container,
    whose own header must be the envelope's, or as they travelled."""
    header = item.spec.header
    if header is None:
        return torch.as_tensor(payload)
    data = np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
    try:
        actual = probe_video(data, max_frame_pixels=header.width * header.height)
        if actual != header:
            raise GridMismatch(
                f"video {item.where}: its bytes hold a {actual.width}x{actual.height} "
                f"{actual.codec} video of {actual.frames} frames at {actual.fps:g} fps, its "
                f"envelope declared {header.width}x{header.height} {header.codec}, "
                f"{header.frames} frames at {header.fps:g} fps"
            )
        return torch.from_numpy(decode_frames(data, header, item.spec.plan.indices))
    except MaterializeError as e:
        if item.where in str(e):
            raise
        raise type(e)(f"video {item.where}: {e}") from e.__cause__
