"""InternVL 2.5, 3 and 3.5: transformers' ``GotOcr2ImageProcessor`` with ``crop_to_patches``.
An image is resized (BICUBIC) to the grid of whole 448 x 448 tiles, 1 to 12 of them, whose
aspect ratio is closest to its own; each tile is a ``(3, 448, 448)`` entry of
``pixel_values``, left to right and top to bottom, and an image of more than one tile adds
a thumbnail, the whole image resized to one tile. Each entry is 256 LLM tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, ClassVar, Literal

from mmwire.transport import Grid, PreprocessSpec, Processor, ResizePlan
from mmwire.transport.errors import ConfigurationError
from mmwire.transport.images import MAX_IMAGE_PIXELS

from ._params import height_width, leftover, required, take, triple

__all__ = ["InternVLConfig", "internvl_config", "internvl_image_prompt", "plan_tiles"]

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as checkpoints write `resample`
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@lru_cache(maxsize=16)
def _arrangements(lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """Every ``(columns, rows)`` of ``lo`` to ``hi`` tiles, by tile count (stable), as
    transformers' ``get_all_supported_aspect_ratios`` lists them."""
    found = [(c, r) for c in range(1, hi + 1) for r in range(1, hi + 1) if lo <= c * r <= hi]
    return tuple(sorted(found, key=lambda g: g[0] * g[1]))


def tile_grid(
    width: int, height: int, tile: tuple[int, int], tiles: tuple[int, int]
) -> tuple[int, int]:
    """``(columns, rows)`` of an image's tiles: transformers' ``get_optimal_tiled_canvas``,
    operation for operation (the closest aspect ratio; on a tie, the later arrangement while
    the image covers more than half of its area)."""
    th, tw = tile
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for grid in _arrangements(*tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * th * tw * grid[0] * grid[1]:
            best = grid
    return best


def plan_tiles(
    width: int,
    height: int,
    *,
    tile: tuple[int, int],
    tiles: tuple[int, int],
    tokens_per_tile: int,
) -> ResizePlan:
    """The plan of a ``width x height`` image: resized to its grid of whole tiles, one row a
    tile plus a thumbnail's when there is more than one, ``tokens_per_tile`` tokens a row."""
    cols, rows = tile_grid(width, height, tile, tiles)
    n = cols * rows + (cols * rows > 1)
    return ResizePlan(
        width=width,
        height=height,
        new_width=tile[1] * cols,
        new_height=tile[0] * rows,
        pad_width=0,
        pad_height=0,
        grid=Grid((n, 1, 1)),
        tokens=tokens_per_tile * n,
    )


@dataclass(frozen=True)
class InternVLConfig:
    """An InternVL checkpoint's image preprocessing (defaults: the InternVL3 ``-hf``
    checkpoints' ``preprocessor_config.json``: 448 x 448 tiles, 1 to 12 of them, BICUBIC,
    ImageNet mean and std, 256 tokens a tile). Called with an image's size it gives that
    image's spec (``Item(preprocess=config)``)."""

    processor: ClassVar[Processor] = "internvl"

    family: str = "internvl3"
    tile_height: int = 448
    tile_width: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    tokens_per_tile: int = 256
    """LLM tokens of one tile (the processor's ``image_seq_length``)."""
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STD
    rescale_factor: float = 1 / 255
    max_input_pixels: int = MAX_IMAGE_PIXELS
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.images.MAX_IMAGE_PIXELS``)."""
    patch_size: int = 14
    """The vision tower's patch (InternViT's 14); the pixels do not depend on it."""

    def __post_init__(self) -> None:
        if min(self.tile_height, self.tile_width, self.tokens_per_tile) <= 0:
            raise ConfigurationError(f"tile sizes and tokens must be positive: {self}")
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ConfigurationError(
                f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}"
            )

    @property
    def alpha(self) -> Literal["keep", "white"]:
        """Transparency is composited over white on the producer (``convert_to_rgb``)."""
        return "white"

    @property
    def merge_kernel(self) -> tuple[int, int]:
        """No merge window: each tile is one row."""
        return (1, 1)

    @property
    def tile(self) -> tuple[int, int]:
        """One tile's ``(height, width)``."""
        return (self.tile_height, self.tile_width)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One tile's entry of ``pixel_values``: ``(3, h, w)``."""
        return (3, self.tile_height, self.tile_width)

    def plan(self, width: int, height: int) -> ResizePlan:
        """The plan of a ``width x height`` image: its tiles and thumbnail."""
        return plan_tiles(
            width,
            height,
            tile=self.tile,
            tiles=(self.min_tiles, self.max_tiles),
            tokens_per_tile=self.tokens_per_tile,
        )

    def tokens(self, width: int, height: int) -> int:
        """LLM tokens of a ``width x height`` image: ``tokens_per_tile`` a row."""
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
            tile=self.tile,
            tiles=(self.min_tiles, self.max_tiles),
        )


def internvl_config(base: InternVLConfig, given: dict[str, Any]) -> InternVLConfig:
    """InternVL's keys (``GotOcr2ImageProcessor``'s): ``size`` as one tile's ``height`` and
    ``width``, ``min_patches``/``max_patches`` as the tile range, BICUBIC, every step on;
    ``crop_to_patches`` false means one tile."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        required(given, key, True, "mmwire runs the reference's every step")
    required(given, "resample", _BICUBIC, "InternVL's pixels are Pillow's BICUBIC")
    for key in ("do_center_crop", "crop_size"):  # the processor never reads them
        if given.pop(key, None) not in (None, False):
            raise ConfigurationError(f"`{key}` must be null: InternVL does not center-crop")
    out: dict[str, Any] = {}
    size = height_width(given)
    if size is not None:
        out["tile_height"], out["tile_width"] = size
    take(
        given,
        out,
        {
            "image_mean": triple,
            "image_std": triple,
            "rescale_factor": float,
            "min_patches": int,
            "max_patches": int,
            "image_seq_length": int,
        },
    )
    for old, new in (
        ("min_patches", "min_tiles"),
        ("max_patches", "max_tiles"),
        ("image_seq_length", "tokens_per_tile"),
    ):
        if old in out:
            out[new] = out.pop(old)
    crop = given.pop("crop_to_patches", True)
    leftover(given)
    config = replace(base, **out)
    if not crop or config.max_tiles <= 1:  # the processor then resizes to one tile
        config = replace(config, min_tiles=1, max_tiles=1)
    return config


def internvl_image_prompt(
    tiles: int,
    tokens_per_tile: int = 256,
    *,
    start: str = "<img>",
    context: str = "<IMG_CONTEXT>",
    end: str = "</img>",
) -> str:
    """What ``InternVLProcessor`` puts in the prompt for an image of ``tiles`` rows (tiles
    and thumbnail): ``tokens_per_tile`` context tokens a row between the image's start and
    end."""
    return f"{start}{context * (tokens_per_tile * tiles)}{end}"
