"""Qwen-VL video: transformers' ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL) and
``Qwen3VLVideoProcessor`` (Qwen3-VL), from a container's header to ``pixel_values_videos``.

A video's plan comes from its header alone (frame count, frame rate, size): which frames
the processor samples, the size every frame is resized to, the grid ``(t, h, w)``, the LLM
tokens, and for Qwen3-VL the timestamp of each temporal patch (its prompt's
``<t seconds>``). The producer computes it; the owner decodes only the sampled frames and
runs the pixels.

The pixels are the reference's torch operations, in its order, on the same tensors: the
processors resize video frames with torchvision, which on the CPU hands uint8 frames to
``torch.nn.functional.interpolate`` (bicubic, antialiased, integer weights: not Pillow's
BICUBIC), then normalise in float32 with mean and std pre-scaled by ``1/rescale_factor``,
then repeat the last frame up to a whole temporal patch and patchify. Running the same
calls makes the CPU path equal to transformers' by construction, for whatever torch is
installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch
from mmwire.transport import EncodedVideo, Grid
from mmwire.transport.errors import ConfigurationError, MaterializeError, MmwireError
from mmwire.transport.videos import VideoConfig, VideoPlan, VideoSpec

from ._params import leftover, take
from ._qwen import check_aspect, fit_area, smart_resize, windowed_fields

__all__ = [
    "MAX_DECODED_BYTES",
    "RAW_VIDEO_FPS",
    "VIDEO_FAMILIES",
    "QwenVideoConfig",
    "video_pixel_values",
    "video_spec_for",
]

MAX_DECODED_BYTES = 1 << 30
"""The default ceiling on one video's sampled RGB frames (what the owner holds decoded)."""

RAW_VIDEO_FPS = 24.0
"""The frame rate of frames given without one: Qwen3-VL's processor assumes it for the
timestamps of pre-sampled frames."""


class QwenVideoConfig(VideoConfig, frozen=True, kw_only=True):
    """A Qwen-VL checkpoint's video preprocessing (its ``video_preprocessor_config.json``),
    the wire's :class:`~mmwire.transport.VideoConfig` with the processor's planning.
    Defaults: transformers' ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL); Qwen3-VL's
    are in :data:`VIDEO_FAMILIES`.

    ``do_sample_frames`` off means every frame of the container, as the processor takes
    them; on, ``fps`` (or ``num_frames``) picks them the family's way. ``max_frames`` and
    ``max_decoded_bytes`` bound what one video may make an owner decode and hold.

    Called with a container's header (or a ``(frames, height, width)`` shape for frames
    given decoded) it gives the video's :class:`~mmwire.transport.VideoSpec`: pass it as
    a video ``Item``'s ``preprocess``."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except MmwireError as e:
            raise ConfigurationError(str(e)) from e

    @classmethod
    def of(cls, config: VideoConfig) -> QwenVideoConfig:
        """The planning config of a wire config (as an envelope carries it)."""
        if isinstance(config, cls):
            return config
        return cls(**msgspec.structs.asdict(config))

    def __call__(self, video: EncodedVideo | tuple[int, int, int]) -> VideoSpec:
        """The spec of a container (its header) or of ``(frames, height, width)`` frames."""
        if isinstance(video, EncodedVideo):
            return VideoSpec(config=self, plan=self.plan(video), header=video)
        frames, height, width = video
        return VideoSpec(config=self, plan=self.plan_frames(frames, RAW_VIDEO_FPS, height, width))

    def sample(self, frames: int, fps: float) -> tuple[int, ...]:
        """The frame numbers the processor takes of a ``frames``-frame video at ``fps``."""
        if not self.do_sample_frames or (
            self.sampler == "qwen2_vl" and self.fps is None and self.num_frames is None
        ):
            if frames > self.max_frames:
                raise MaterializeError(
                    f"a video of {frames} frames, over max_frames {self.max_frames}: sample "
                    "it (do_sample_frames with fps)"
                )
            return tuple(range(frames))
        if self.sampler == "qwen2_vl":
            return _sample_qwen2(self, frames, fps)
        return _sample_qwen3(self, frames, fps)

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` every one of ``frames`` sampled frames is resized to."""
        f, t = self.factor, self.temporal_patch_size
        if self.sampler == "qwen2_vl":
            limit = self.max_pixels
            if self.cap_pixels_per_frame:
                total = int(self.max_video_tokens * f * f * 0.9)
                limit = max(min(limit, total * t // frames), int(self.min_pixels * 1.05))
            return smart_resize(
                height, width, factor=f, min_pixels=self.min_pixels, max_pixels=limit
            )
        limit = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(
                min(self.max_video_tokens * f * f, self.max_pixels // frames),
                int(self.min_pixels * 1.05),
            )
            limit = per_frame * frames
        return _smart_resize_qwen3(frames, height, width, t, f, self.min_pixels, limit)

    def plan(self, video: EncodedVideo) -> VideoPlan:
        """The plan of a video from its header (``MaterializeError`` for one the processor
        refuses or that exceeds this config's bounds)."""
        return self.plan_frames(video.frames, video.fps, video.height, video.width)

    def plan_frames(self, frames: int, fps: float, height: int, width: int) -> VideoPlan:
        """The plan of ``frames`` frames of ``width x height`` at ``fps`` (for raw frames,
        the frames given are the video: pass ``do_sample_frames=False`` configs)."""
        if frames <= 0 or height <= 0 or width <= 0:
            raise MaterializeError(f"an empty video: {frames} frames of {width}x{height}")
        indices = self.sample(frames, fps)
        n = len(indices)
        if n * width * height * 3 > self.max_decoded_bytes:
            raise MaterializeError(
                f"{n} sampled frames of {width}x{height} decode to "
                f"{n * width * height * 3} bytes, over max_decoded_bytes {self.max_decoded_bytes}"
            )
        new_h, new_w = self.resized(n, height, width)
        t = -(-n // self.temporal_patch_size)
        gh, gw = new_h // self.patch_size, new_w // self.patch_size
        stamps = None
        if self.sampler == "qwen3_vl":
            stamps = _timestamps(indices, fps, self.temporal_patch_size)
        return VideoPlan(
            indices=indices,
            width=width,
            height=height,
            new_width=new_w,
            new_height=new_h,
            grid=Grid((t, gh, gw)),
            tokens=t * gh * gw // (self.merge_size * self.merge_size),
            timestamps=stamps,
        )


def _sample_qwen2(config: QwenVideoConfig, total: int, fps: float) -> tuple[int, ...]:
    """``Qwen2VLVideoProcessor.sample_frames``, operation for operation (``sample`` takes
    every frame itself when neither ``num_frames`` nor ``fps`` is set)."""
    t = config.temporal_patch_size
    n: float
    if config.num_frames is not None:
        n = round(config.num_frames / t) * t
    else:
        most = math.floor(min(config.max_frames, total) / t) * t
        n = min(max(total / fps * (config.fps or 0.0), config.min_frames), most, total)
        n = math.floor(n / t) * t
    if n <= 0 or n > total:
        raise MaterializeError(f"a video of {total} frames cannot be sampled to {n} frames")
    indices = torch.arange(0, total, total / n).int()
    return tuple(int(i) for i in indices.tolist())


def _sample_qwen3(config: QwenVideoConfig, total: int, fps: float) -> tuple[int, ...]:
    """``Qwen3VLVideoProcessor.sample_frames``, operation for operation."""
    if config.num_frames is not None:
        n = config.num_frames
    elif config.fps is not None:
        n = min(max(int(total / fps * config.fps), config.min_frames), config.max_frames, total)
    else:
        n = min(max(total, config.min_frames), config.max_frames)
    if n <= 0 or n > config.max_frames:
        raise MaterializeError(f"a video of {total} frames cannot be sampled to {n} frames")
    indices = np.linspace(0, total - 1, n).round().astype(int)
    return tuple(int(i) for i in indices.tolist())


def _smart_resize_qwen3(
    frames: int, height: int, width: int, t: int, f: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: small frames scaled up to ``f`` first, then the
    area bounded with ``frames`` frames counted (rounded to whole temporal patches in the
    test, unrounded in the scale)."""
    if frames < t:
        raise MaterializeError(f"{frames} sampled frames, fewer than the temporal patch {t}")
    if height < f or width < f:
        scale = max(f / height, f / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect(height, width)
    return fit_area(
        height,
        width,
        factor=f,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        frames=frames,
        tested_frames=round(frames / t) * t,
    )


def _timestamps(indices: Sequence[int], fps: float, merge: int) -> tuple[float, ...]:
    """``Qwen3VLProcessor._calculate_timestamps``: each temporal patch's mean of its first
    and last frame's time (the last frame repeated to fill the final patch)."""
    idx = list(indices)
    if len(idx) % merge:
        idx.extend(idx[-1] for _ in range(merge - len(idx) % merge))
    times = [i / fps for i in idx]
    return tuple((times[i] + times[i + merge - 1]) / 2 for i in range(0, len(times), merge))


def _scaled_normalisation(config: VideoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std in 0-255 units, float32, made as torchvision's fused rescale-and-
    normalise makes them (so the division by ``std`` is the only rounding after them)."""
    mean = torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std) * (1.0 / config.rescale_factor)
    return mean, std


def normalisation(config: VideoConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The float32 mean and std (0-255 units) every video pixel is normalised with."""
    mean, std = _scaled_normalisation(config)
    return tuple(mean.tolist()), tuple(std.tolist())


def video_pixel_values(
    frames: np.ndarray[Any, Any] | torch.Tensor | Sequence[np.ndarray[Any, Any]],
    plan: VideoPlan,
    config: QwenVideoConfig,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``pixel_values_videos`` of one video: uint8 RGB ``(T, H, W, 3)`` frames, or a list of
    ``(H, W, 3)`` ones (the plan's sampled frames, in order), to ``(t·h·w, 3·T·p·p)`` rows,
    equal to transformers'. ``MaterializeError`` for frames of another shape or dtype."""
    if isinstance(frames, (list, tuple)):  # a list of (H, W, 3) frames is one video
        frames = np.stack([np.asarray(f) for f in frames]) if frames else np.empty(0, np.uint8)
    x = torch.as_tensor(frames)
    n = len(plan.indices)
    if x.dtype != torch.uint8 or tuple(x.shape) != (n, plan.height, plan.width, 3):
        raise MaterializeError(
            f"frames must be uint8 ({n}, {plan.height}, {plan.width}, 3), got "
            f"{x.dtype} {tuple(x.shape)}"
        )
    x = x.permute(0, 3, 1, 2).contiguous()
    size = [plan.new_height, plan.new_width]
    if (plan.new_height, plan.new_width) != (plan.height, plan.width):
        x = torch.nn.functional.interpolate(
            x, size=size, mode="bicubic", align_corners=False, antialias=True
        )
    mean, std = _scaled_normalisation(config)
    x = x.to(torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    t, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -n % t:
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)), dim=0)
    gt, gh, gw = plan.grid.thw
    rows = x.view(gt, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    out = rows.reshape(gt * gh * gw, 3 * t * p * p)
    return out if dtype == torch.float32 else out.to(dtype)


_QWEN3_VIDEO = QwenVideoConfig(
    family="qwen3-vl",
    sampler="qwen3_vl",
    patch_size=16,
    min_pixels=128 * 32 * 32,
    max_pixels=32 * 32 * 768,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    do_sample_frames=True,
    fps=2,
    max_video_tokens=768,
)

VIDEO_FAMILIES: dict[str, QwenVideoConfig] = {
    "qwen2-vl": QwenVideoConfig(family="qwen2-vl"),
    "qwen2.5-vl": QwenVideoConfig(),
    "qwen3-vl": _QWEN3_VIDEO,
}
"""Each family's video preprocessing with transformers' defaults."""

_IGNORED = frozenset(
    {
        "video_processor_type",
        "processor_class",
        "image_processor_type",
        "return_metadata",
        "data_format",
        "input_data_format",
        "return_tensors",
        "device",
        "default_to_square",
        "do_pad",
        "do_center_crop",
        "crop_size",
        "video_metadata",
        "model_type",
        "max_image_size",
        "max_duration",
    }
)


def video_spec_for(family: str, params: Mapping[str, Any] | None = None) -> QwenVideoConfig:
    """The video preprocessing of ``family`` (a key of :data:`VIDEO_FAMILIES`) for a
    checkpoint whose video processor parameters are ``params`` (its
    ``video_preprocessor_config.json``, plus any call-time settings such as ``fps``;
    omitted keys keep transformers' defaults). ``ConfigurationError`` for a key it does
    not read or a value it cannot reproduce."""
    base = VIDEO_FAMILIES.get(family)
    if base is None:
        raise ConfigurationError(
            f"no video preprocessing for {family!r}; one of {sorted(VIDEO_FAMILIES)}"
        )
    given = {k: v for k, v in (params or {}).items() if k not in _IGNORED}
    try:
        out = windowed_fields(given)
        take(
            given,
            out,
            {
                "do_sample_frames": bool,
                "fps": lambda v: None if v is None else float(v),
                "num_frames": lambda v: None if v is None else int(v),
                "min_frames": int,
                "max_frames": int,
                "cap_pixels_per_frame": lambda v: bool(v),
                "max_video_tokens": int,
                "min_pixels": int,
                "max_pixels": int,
            },
        )
        leftover(given)
        return msgspec.structs.replace(base, **out)
    except ConfigurationError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigurationError(f"{family}: bad video processor parameters: {e}") from e
