"""Gemma 3: transformers' ``Gemma3ImageProcessor``. Every image is resized with Pillow's
BILINEAR to one fixed size (896 x 896 in the checkpoints), rescaled, normalised, and
becomes one ``(3, H, W)`` entry of ``pixel_values``; the processor gives it
``image_seq_length`` tokens (256) whatever its size. Pan-and-scan (extra crops of wide or
tall images) is off in the checkpoints and refused here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from mmwire.transport import Grid, PreprocessSpec, Processor, ResizePlan
from mmwire.transport.errors import ConfigurationError
from mmwire.transport.images import MAX_IMAGE_PIXELS

from ._params import leftover, required, take, triple

__all__ = ["Gemma3Config", "gemma3_config", "gemma3_image_prompt", "plan_whole_resize"]

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as checkpoints write `resample`
_PAN_AND_SCAN_KEYS = (
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


def plan_whole_resize(
    width: int, height: int, *, new_width: int, new_height: int, tokens: int
) -> ResizePlan:
    """The plan of a ``width x height`` image resized whole to ``new_width x new_height``:
    no padding, one row (grid ``(1, 1, 1)``), ``tokens`` tokens."""
    return ResizePlan(
        width=width,
        height=height,
        new_width=new_width,
        new_height=new_height,
        pad_width=0,
        pad_height=0,
        grid=Grid((1, 1, 1)),
        tokens=tokens,
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
        """The plan of a ``width x height`` image: resized whole to the fixed size."""
        return plan_whole_resize(
            width,
            height,
            new_width=self.width,
            new_height=self.height,
            tokens=self.image_seq_length,
        )

    def tokens(self, width: int, height: int) -> int:
        """LLM tokens of an image: ``image_seq_length``, whatever its size."""
        return self.image_seq_length

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
        )


def gemma3_config(base: Gemma3Config, given: dict[str, Any]) -> Gemma3Config:
    """Gemma 3's keys: ``size`` as ``height`` and ``width``, BILINEAR, every step on; the
    pan-and-scan parameters only with pan-and-scan off (``do_pan_and_scan`` false or null,
    as the checkpoints write it)."""
    for key in ("do_resize", "do_rescale", "do_normalize"):
        required(given, key, True, "mmwire runs the reference's every step")
    if given.pop("do_convert_rgb", None) not in (None, True):
        raise ConfigurationError("`do_convert_rgb` must be true or null: images become RGB")
    required(given, "resample", _BILINEAR, "Gemma 3's pixels are Pillow's BILINEAR")
    if given.pop("do_pan_and_scan", None) not in (None, False):
        raise ConfigurationError(
            "`do_pan_and_scan` must be false or null: mmwire does not reproduce pan-and-scan's "
            "crops"
        )
    for key in _PAN_AND_SCAN_KEYS:  # read only by pan-and-scan
        given.pop(key, None)
    out: dict[str, Any] = {}
    size = given.pop("size", None)
    if size is not None:
        size = dict(size)
        h, w = size.pop("height", None), size.pop("width", None)
        if size or h is None or w is None:
            raise ConfigurationError(
                f"`size` must give `height` and `width`, got {given.get('size', size)}"
            )
        out["height"], out["width"] = int(h), int(w)
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
    *,
    boi: str = "<start_of_image>",
    image: str = "<image_soft_token>",
    eoi: str = "<end_of_image>",
) -> str:
    """What ``Gemma3Processor`` puts in the prompt for one image: its begin-of-image token
    becomes this, ``tokens`` image tokens between the image's begin and end."""
    return f"\n\n{boi}{image * tokens}{eoi}\n\n"
