"""Gemma 3: transformers' ``Gemma3ImageProcessor``. Every image is resized with Pillow's
BILINEAR to one fixed size (896 x 896 in the checkpoints), rescaled, normalised, and
becomes one ``(3, H, W)`` entry of ``pixel_values``; the processor gives it
``image_seq_length`` tokens (256) whatever its size. With pan-and-scan (off in the
checkpoints), a wide or tall image also gets side-by-side crops of itself, each resized the
same way into an entry of its own, ``image_seq_length`` tokens each."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from mmwire.transport import Grid, PanAndScan, PreprocessSpec, Processor, ResizePlan
from mmwire.transport.errors import ConfigurationError
from mmwire.transport.images import MAX_IMAGE_PIXELS

from ._params import height_width, leftover, required, take, triple

__all__ = [
    "Gemma3Config",
    "gemma3_config",
    "gemma3_image_prompt",
    "pan_and_scan_crops",
    "plan_whole_resize",
]

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as checkpoints write `resample`
_PAN_AND_SCAN_KEYS = (
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)
_PAN_DEFAULTS = (256, 4, 1.2)  # Gemma3Processor's, where the config leaves them null


def pan_and_scan_crops(
    width: int, height: int, pan: PanAndScan | None
) -> list[tuple[int, int, int, int]]:
    """The crops pan-and-scan takes of a ``width x height`` image, as ``(x, y, w, h)`` boxes
    clipped to the image, left to right then top to bottom: transformers'
    ``Gemma3ImageProcessor.pan_and_scan``, operation for operation (none without it)."""
    if pan is None:
        return []
    if width >= height:
        if width / height < pan.min_ratio:
            return []
        cols = math.floor(width / height + 0.5)  # half rounds up
        cols = min(math.floor(width / pan.min_crop), cols)
        cols = min(pan.max_crops, max(2, cols))
        rows = 1
    else:
        if height / width < pan.min_ratio:
            return []
        rows = math.floor(height / width + 0.5)
        rows = min(math.floor(height / pan.min_crop), rows)
        rows = min(pan.max_crops, max(2, rows))
        cols = 1
    crop_w, crop_h = math.ceil(width / cols), math.ceil(height / rows)
    if min(crop_w, crop_h) < pan.min_crop:
        return []
    boxes = []
    for y in (crop_h * i for i in range(rows)):
        for x in (crop_w * i for i in range(cols)):
            boxes.append((x, y, min(crop_w, width - x), min(crop_h, height - y)))
    return boxes


def plan_whole_resize(
    width: int,
    height: int,
    *,
    new_width: int,
    new_height: int,
    tokens: int,
    pan: PanAndScan | None = None,
) -> ResizePlan:
    """The plan of a ``width x height`` image resized whole to ``new_width x new_height``:
    no padding, one row and one a pan-and-scan crop (grid ``(1 + crops, 1, 1)``),
    ``tokens`` tokens a row."""
    rows = 1 + len(pan_and_scan_crops(width, height, pan))
    return ResizePlan(
        width=width,
        height=height,
        new_width=new_width,
        new_height=new_height,
        pad_width=0,
        pad_height=0,
        grid=Grid((rows, 1, 1)),
        tokens=tokens * rows,
    )


@dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 checkpoint's image preprocessing (defaults: the published checkpoints'
    ``preprocessor_config.json``: 896 x 896, BILINEAR, mean and std 0.5, 256 tokens).
    Called with an image's size it gives that image's spec (``Item(preprocess=config)``)."""

    processor: ClassVar[Processor] = "gemma3"

    family: str = "gemma-3"
    width: int = 896
    height: int = 896
    image_seq_length: int = 256
    """LLM tokens of one image (the processor's ``image_seq_length``)."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    max_input_pixels: int = MAX_IMAGE_PIXELS
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.images.MAX_IMAGE_PIXELS``)."""
    patch_size: int = 14
    """The vision tower's patch (SigLIP's 14); the pixels do not depend on it."""
    pan_and_scan: PanAndScan | None = None
    """Pan-and-scan's parameters, or ``None`` (off, as in the checkpoints)."""

    def __post_init__(self) -> None:
        if min(self.width, self.height, self.image_seq_length) <= 0:
            raise ConfigurationError(f"sizes and image_seq_length must be positive: {self}")

    @property
    def alpha(self) -> Literal["keep", "white"]:
        """Transparency is composited over white on the producer (``convert_to_rgb``)."""
        return "white"

    @property
    def merge_kernel(self) -> tuple[int, int]:
        """No merge window: the whole image is one row."""
        return (1, 1)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One image's entry of ``pixel_values``: ``(3, H, W)``."""
        return (3, self.height, self.width)

    def plan(self, width: int, height: int) -> ResizePlan:
        """The plan of a ``width x height`` image: resized whole to the fixed size, and so
        is each of its pan-and-scan crops."""
        return plan_whole_resize(
            width,
            height,
            new_width=self.width,
            new_height=self.height,
            tokens=self.image_seq_length,
            pan=self.pan_and_scan,
        )

    def tokens(self, width: int, height: int) -> int:
        """LLM tokens of an image: ``image_seq_length`` for it and for each crop."""
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
            rescale_factor=self.rescale_factor,
            pan_and_scan=self.pan_and_scan,
        )


def gemma3_config(base: Gemma3Config, given: dict[str, Any]) -> Gemma3Config:
    """Gemma 3's keys: ``size`` as ``height`` and ``width``, BILINEAR, every step on;
    pan-and-scan on with ``do_pan_and_scan`` true, its parameters (null: the processor's
    defaults, 256, 4 and 1.2) read only then."""
    for key in ("do_resize", "do_rescale", "do_normalize"):
        required(given, key, True, "mmwire runs the reference's every step")
    if given.pop("do_convert_rgb", None) not in (None, True):
        raise ConfigurationError("`do_convert_rgb` must be true or null: images become RGB")
    required(given, "resample", _BILINEAR, "Gemma 3's pixels are Pillow's BILINEAR")
    pan_on = given.pop("do_pan_and_scan", None)
    if pan_on not in (None, False, True):
        raise ConfigurationError(f"`do_pan_and_scan` must be true, false or null, got {pan_on}")
    pan = [given.pop(key, None) for key in _PAN_AND_SCAN_KEYS]
    out: dict[str, Any] = {}
    if pan_on:
        min_crop, max_crops, min_ratio = (d if v is None else v for v, d in zip(pan, _PAN_DEFAULTS))
        out["pan_and_scan"] = PanAndScan(int(min_crop), int(max_crops), float(min_ratio))
    size = height_width(given)
    if size is not None:
        out["height"], out["width"] = size
    take(
        given,
        out,
        {
            "image_mean": triple,
            "image_std": triple,
            "rescale_factor": float,
            "image_seq_length": int,
        },
    )
    leftover(given)
    return replace(base, **out)


def gemma3_image_prompt(
    tokens: int = 256,
    crops: int = 0,
    *,
    boi: str = "<start_of_image>",
    image: str = "<image_soft_token>",
    eoi: str = "<end_of_image>",
) -> str:
    """What ``Gemma3Processor`` puts in the prompt for one image of ``crops`` pan-and-scan
    crops (its grid's ``t`` less one): its begin-of-image token becomes ``tokens`` image
    tokens between the image's begin and end, and with crops one such run for the image and
    one a crop, in the processor's own words."""
    one = f"\n\n{boi}{image * tokens}{eoi}\n\n"
    if not crops:
        return one
    return (
        f"Here is the original image {one} and here are some crops to help you see better "
        + " ".join([one] * crops)
    )
