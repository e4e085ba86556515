"""Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): transformers' ``smart_resize`` and
``QwenVLConfig``, the checkpoint's preprocessing that yields each image's spec."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from mmwire.transport import Grid, PreprocessSpec, Processor, ResizePlan
from mmwire.transport.errors import ConfigurationError, MaterializeError
from mmwire.transport.images import MAX_IMAGE_PIXELS

from ._params import leftover, required, take, triple

__all__ = [
    "MAX_ASPECT_RATIO",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "QwenVLConfig",
    "check_aspect",
    "check_size",
    "fit_area",
    "plan_smart_resize",
    "qwen_config",
    "smart_resize",
    "windowed_fields",
    "windowed_plan",
]

MAX_ASPECT_RATIO = 200
"""``smart_resize`` refuses images whose long side is more than this times the short one."""

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor configs write it


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's target ``(height, width)``: each side a multiple of ``factor``, the area
    within ``[min_pixels, max_pixels]`` where it can be, the aspect ratio kept as closely as
    that allows (transformers' ``smart_resize``, operation for operation: Python's ``round``
    takes halves to even). Raises ``MaterializeError`` for an aspect ratio over 200."""
    check_size(height, width)
    check_aspect(height, width)
    return fit_area(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def check_size(height: int, width: int) -> None:
    """``MaterializeError`` for a side that is not positive."""
    if width <= 0 or height <= 0:
        raise MaterializeError(f"image size must be positive, got {width}x{height}")


def check_aspect(height: int, width: int) -> None:
    """``MaterializeError`` for an aspect ratio over ``MAX_ASPECT_RATIO``, in transformers'
    words."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MaterializeError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)} ({width}x{height})"
        )


def fit_area(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    tested_frames: int | None = None,
) -> tuple[int, int]:
    """The step Qwen-VL's and GLM-4V's ``smart_resize`` share: each side rounded to a
    multiple of ``factor`` (halves to even), then, if ``tested_frames`` (default
    ``frames``) frames of that size fall outside ``[min_pixels, max_pixels]``, both sides
    scaled by the same factor beta (from ``frames`` frames) and floored (too large) or
    ceiled (too small) to multiples of ``factor``. Qwen3-VL's video test counts whole
    temporal patches and its beta the frames themselves."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    tested = frames if tested_frames is None else tested_frames
    if tested * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif tested * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width * frames))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def windowed_plan(
    width: int, height: int, new_height: int, new_width: int, *, patch_size: int, merge_size: int
) -> ResizePlan:
    """The plan of a ``width x height`` image resized to ``new_width x new_height`` with
    Qwen-VL's rows: no padding, grid ``(1, H/p, W/p)``, ``h·w / m²`` tokens."""
    gh, gw = new_height // patch_size, new_width // patch_size
    return ResizePlan(
        width=width,
        height=height,
        new_width=new_width,
        new_height=new_height,
        pad_width=0,
        pad_height=0,
        grid=Grid((1, gh, gw)),
        tokens=gh * gw // (merge_size * merge_size),
    )


def plan_smart_resize(
    width: int,
    height: int,
    *,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
) -> ResizePlan:
    """Qwen-VL's plan of a ``width x height`` image: ``smart_resize`` with factor
    ``patch_size · merge_size``, no padding, grid ``(1, H/p, W/p)``, ``h·w / m²`` tokens."""
    f = patch_size * merge_size
    new_h, new_w = smart_resize(
        height, width, factor=f, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return windowed_plan(width, height, new_h, new_w, patch_size=patch_size, merge_size=merge_size)


@dataclass(frozen=True)
class QwenVLConfig:
    """A Qwen-VL checkpoint's image preprocessing (transformers' ``Qwen2VLImageProcessor``,
    shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL). Defaults: the Qwen2.5-VL checkpoints'.
    Called with an image's size it gives that image's spec (``Item(preprocess=config)``)."""

    processor: ClassVar[Processor] = "qwen2_vl"
    """The wire's name for these semantics (a family with its own plan names its own)."""

    family: str = "qwen2.5-vl"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 3136
    """Least area ``smart_resize`` targets (the config's ``size.shortest_edge``)."""
    max_pixels: int = 12_845_056
    """Largest area ``smart_resize`` targets (the config's ``size.longest_edge``)."""
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_input_pixels: int = MAX_IMAGE_PIXELS
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.images.MAX_IMAGE_PIXELS``)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigurationError(
                f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )
        if min(self.patch_size, self.merge_size, self.temporal_patch_size) <= 0:
            raise ConfigurationError(f"sizes must be positive: {self}")

    @property
    def alpha(self) -> Literal["keep", "white"]:
        """Transparency is composited over white on the producer (``convert_to_rgb``)."""
        return "white"

    @property
    def merge_kernel(self) -> tuple[int, int]:
        """The merge window ``(m, m)`` the LLM tokens pool."""
        return (self.merge_size, self.merge_size)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One patch's row of ``pixel_values``: ``(3·T·p·p,)``."""
        return (3 * self.temporal_patch_size * self.patch_size * self.patch_size,)

    def plan(self, width: int, height: int) -> ResizePlan:
        """The ``smart_resize`` plan of a ``width x height`` image (``MaterializeError``
        past the aspect-ratio limit)."""
        return plan_smart_resize(
            width,
            height,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def tokens(self, width: int, height: int) -> int:
        """LLM tokens of a ``width x height`` image."""
        return self.plan(width, height).tokens

    def __call__(self, width: int, height: int) -> PreprocessSpec:
        """The preprocessing spec of one ``width x height`` image under this config."""
        return PreprocessSpec(
            plan=self.plan(width, height),
            image_mean=self.image_mean,
            image_std=self.image_std,
            patch_size=self.patch_size,
            merge_kernel=self.merge_kernel,
            processor=self.processor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            temporal_patch_size=self.temporal_patch_size,
            rescale_factor=self.rescale_factor,
        )


def qwen_config(base: QwenVLConfig, given: dict[str, Any]) -> QwenVLConfig:
    """transformers' precedence: ``size`` (pixel counts named ``shortest_edge`` and
    ``longest_edge``), then top-level ``min_pixels``/``max_pixels`` over it."""
    out = windowed_fields(given)
    take(given, out, {"min_pixels": int, "max_pixels": int})
    leftover(given)
    return replace(base, **out)


def windowed_fields(given: dict[str, Any]) -> dict[str, Any]:
    """The keys a Qwen-VL-style processor shares (``size`` as pixel counts, patch, merge
    and temporal sizes, mean, std, rescale), taken out of ``given``; the steps it must run
    required on."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        required(given, key, True, "mmwire runs the reference's every step")
    required(given, "resample", _BICUBIC, "the kernels reproduce Pillow's BICUBIC")
    out: dict[str, Any] = {}
    size = given.pop("size", None)
    if size is not None:
        size = dict(size)
        lo = size.pop("shortest_edge", size.pop("min_pixels", None))
        hi = size.pop("longest_edge", size.pop("max_pixels", None))
        if size or lo is None or hi is None:
            raise ConfigurationError(
                f"`size` must give `shortest_edge` and `longest_edge` (pixel counts), got "
                f"{given.get('size', size)}"
            )
        out["min_pixels"], out["max_pixels"] = int(lo), int(hi)
    take(
        given,
        out,
        {
            "patch_size": int,
            "temporal_patch_size": int,
            "merge_size": int,
            "image_mean": triple,
            "image_std": triple,
            "rescale_factor": float,
        },
    )
    return out
