"""The feature envelope: the typed, versioned record that crosses process boundaries.

Everything here is a frozen msgspec ``Struct``; there are no free-form dicts, so every field
a consumer reads is one the producer had to write. Cross-field rules live in
``__post_init__`` and raise the matching :class:`EnvelopeError` subclass, both when a
producer builds an envelope and when a consumer decodes one. Ceilings that depend on
configuration (pixels, bytes) are checked by the codec (``Limits``).

The wire format and its evolution rules are written down in ``docs/wire-format.md``.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from ._index import GlobalIndex
from .errors import (
    ByteLengthMismatch,
    DimensionError,
    GridMismatch,
    MalformedEnvelope,
    OffsetError,
    SchemaVersionError,
    UnknownDtype,
)

__all__ = [
    "DTYPES",
    "ENCODED_FORMATS",
    "MAX_VIDEO_SAMPLES",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "VIDEO_CODECS",
    "VIDEO_FORMATS",
    "Background",
    "CpuRef",
    "CudaIpcRef",
    "EncodedImage",
    "EncodedVideo",
    "FabricRef",
    "FeatureEnvelope",
    "Grid",
    "InlineRef",
    "PanAndScan",
    "PayloadRef",
    "PreprocessSpec",
    "Processor",
    "ResizePlan",
    "TensorSpec",
    "VideoConfig",
    "VideoPlan",
    "VideoSampler",
    "VideoSpec",
]

SCHEMA_VERSION = 3
"""Version written by this library."""

READABLE_VERSIONS = (1, 2, 3)
"""Versions decoders accept. Version 2 added the preprocessing spec's ``processor`` and its
Qwen-VL fields; a version-1 envelope decodes with their defaults (Kimi's). The version was
bumped because a version-1 decoder ignores fields it does not know, and would have run a
Qwen item through Kimi's pipeline. Version 3 added video items (``video``), which an older
decoder would read as images without a spec."""

DTYPES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
}
"""Whitelisted dtype names and their item sizes in bytes."""

_MAX_NDIM = 8

Modality = Literal["image", "video", "audio"]
Kind = Literal["raw", "processed", "embedding", "encoded"]
EncodedFormat = Literal["JPEG", "PNG", "WEBP", "GIF", "BMP"]
ENCODED_FORMATS: frozenset[str] = frozenset(("JPEG", "PNG", "WEBP", "GIF", "BMP"))
"""Containers an encoded item may carry (Pillow's format names): what clients send. Others
are decoded on the producer, so an owner never runs a rarer decoder on a peer's bytes."""
Processor = Literal["kimi_vl", "qwen2_vl", "glm4v", "gemma3", "internvl"]
"""Whose image-processor semantics a raw item follows: ``kimi_vl`` (Kimi-K2.5/K3's NaViT
plan, rows ``(3, p, p)``), ``qwen2_vl`` (transformers' ``Qwen2VLImageProcessor``, which
Qwen2-VL, Qwen2.5-VL and Qwen3-VL share: ``smart_resize``, rows ``(3·T·p·p,)`` by merge
window), ``glm4v`` (``Glm4vImageProcessor``, GLM-4.1V/4.5V/4.6V: Qwen-VL's pixels and
rows under GLM's own ``smart_resize``), ``gemma3`` (``Gemma3ImageProcessor``: the whole
image resized to one fixed size with BILINEAR, one row ``(3, H, W)``) or ``internvl``
(``GotOcr2ImageProcessor`` with ``crop_to_patches``, InternVL 2.5/3/3.5: the image resized
to a grid of tiles, each tile a row ``(3, h, w)``, then a thumbnail row)."""
WINDOWED_PROCESSORS: frozenset[str] = frozenset(("qwen2_vl", "glm4v"))
"""The processors whose pixels and rows are Qwen-VL's (they differ only in the plan)."""
TRANSFORMERS_PROCESSORS: frozenset[str] = WINDOWED_PROCESSORS | {"gemma3", "internvl"}
"""The processors that follow transformers' Pillow backend: transparency composited over
white on the producer, values normalised in float32 after a float64 rescale."""
MAX_WHOLE_SIDE = 4096
"""The largest side of a ``gemma3`` target or an ``internvl`` tile (the checkpoints use 896
and 448)."""
MAX_TILES = 64
"""The most tiles an ``internvl`` plan may have (the checkpoints allow 12)."""
MAX_CROPS = 16
"""The most pan-and-scan crops a ``gemma3`` plan may have (the processor's default is 4)."""


class Grid(msgspec.Struct, frozen=True, array_like=True):
    """A patch grid, ``[h, w]`` (Kimi-VL) or ``[t, h, w]`` (K2.5/K3), normalised to one type.

    ``dims`` keeps the form it was given in (``ndim`` says which); ``t`` is 1 for 2-D grids.
    """

    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dims) not in (2, 3):
            raise DimensionError(
                f"`grid` must be [h, w] or [t, h, w], got {len(self.dims)} values {list(self.dims)}"
            )
        for d in self.dims:
            if type(d) is not int or d <= 0:
                raise DimensionError(f"`grid` values must be positive ints, got {list(self.dims)}")

    @classmethod
    def of(cls, values: object) -> Grid:
        """Normalise a 2- or 3-element sequence (list, tuple, tensor row) into a ``Grid``."""
        try:
            dims = tuple(int(v) for v in values)  # type: ignore[attr-defined]
        except TypeError:
            raise DimensionError(f"`grid` must be a sequence of ints, got {values!r}") from None
        return cls(dims)

    @property
    def ndim(self) -> int:
        """2 for an ``[h, w]`` grid, 3 for ``[t, h, w]``."""
        return len(self.dims)

    @property
    def t(self) -> int:
        """Temporal extent (1 for 2-D grids)."""
        return self.dims[0] if len(self.dims) == 3 else 1

    @property
    def h(self) -> int:
        """Height in patches."""
        return self.dims[-2]

    @property
    def w(self) -> int:
        """Width in patches."""
        return self.dims[-1]

    @property
    def thw(self) -> tuple[int, int, int]:
        """The grid as ``(t, h, w)`` whatever form it was given in."""
        return (self.t, self.h, self.w)

    @property
    def patches(self) -> int:
        """Patches of the item: ``t·h·w``."""
        return self.t * self.h * self.w

    def tokens(self, merge_kernel: tuple[int, int] = (2, 2)) -> int:
        """LLM tokens of the item: ``(h·w) // (mh·mw)``; the temporal axis is pooled away."""
        mh, mw = merge_kernel
        return (self.h * self.w) // (mh * mw)


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Dtype (whitelisted), shape and byte length of one payload; all three must agree."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        itemsize = DTYPES.get(self.dtype)
        if itemsize is None:
            raise UnknownDtype(
                f"`tensor.dtype` must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if not 1 <= len(self.shape) <= _MAX_NDIM:
            raise DimensionError(
                f"`tensor.shape` must have 1..{_MAX_NDIM} dims, got {list(self.shape)}"
            )
        if min(self.shape) <= 0:
            raise DimensionError(f"`tensor.shape` dims must be positive, got {list(self.shape)}")
        expected = math.prod(self.shape) * itemsize  # Python ints: no overflow
        if self.nbytes != expected:
            raise ByteLengthMismatch(
                f"`tensor.nbytes` must be prod(shape)*itemsize = {expected} for "
                f"{self.dtype}{list(self.shape)}, got {self.nbytes}"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype]


def _non_negative(where: str, **fields: int) -> None:
    for name, value in fields.items():
        if value < 0:
            raise OffsetError(f"`{where}.{name}` must be >= 0, got {value}")


class InlineRef(msgspec.Struct, frozen=True, kw_only=True, tag="inline", tag_field="backend"):
    """The payload travels as zmq frame number ``frame`` after the header frame."""

    frame: int

    def __post_init__(self) -> None:
        _non_negative("payload", frame=self.frame)


class CpuRef(msgspec.Struct, frozen=True, kw_only=True, tag="cpu", tag_field="backend"):
    """Bytes ``[offset, offset+length)`` of host arena ``arena_id``, inside lease ``lease``.

    ``generation`` must equal the lease's generation in the arena, else the reference is
    stale. Offsets are relative to the arena's start; no pointers ever travel.
    """

    arena_id: str
    lease: int
    offset: int
    length: int
    generation: int

    def __post_init__(self) -> None:
        if min(self.lease, self.offset, self.length, self.generation) < 0:
            _non_negative(
                "payload",
                lease=self.lease,
                offset=self.offset,
                length=self.length,
                generation=self.generation,
            )


class CudaIpcRef(msgspec.Struct, frozen=True, kw_only=True, tag="cuda_ipc", tag_field="backend"):
    """Bytes ``[offset, offset+length)`` of device pool ``pool_id``, in ready/ack slot ``slot``."""

    pool_id: str
    slot: int
    offset: int
    length: int
    generation: int

    def __post_init__(self) -> None:
        _non_negative(
            "payload",
            slot=self.slot,
            offset=self.offset,
            length=self.length,
            generation=self.generation,
        )


class FabricRef(msgspec.Struct, frozen=True, kw_only=True, tag="fabric", tag_field="backend"):
    """Like :class:`CudaIpcRef` for a VMM pool; ``handle`` is the 64-byte FABRIC handle, if any."""

    pool_id: str
    slot: int
    offset: int
    length: int
    generation: int
    handle: bytes | None = None

    def __post_init__(self) -> None:
        _non_negative(
            "payload",
            slot=self.slot,
            offset=self.offset,
            length=self.length,
            generation=self.generation,
        )
        if self.handle is not None and len(self.handle) != 64:
            raise MalformedEnvelope(
                f"`payload.handle` must be a 64-byte FABRIC handle, got {len(self.handle)} bytes"
            )


PayloadRef = InlineRef | CpuRef | CudaIpcRef | FabricRef


class Background(msgspec.Struct, frozen=True, kw_only=True):
    """Transparent-background fill applied after resize (RGBA inputs only).

    Defaults are the processor's when a config omits keys: square 16, top-left white,
    white 255, gray 200. K3 uses ``Background(square=8, gray=180)``.
    """

    pattern: Literal["chessboard", "white", "gray", "black"] = "chessboard"
    square: int = 16
    top_left_white: bool = True
    white: int = 255
    gray: int = 200

    def __post_init__(self) -> None:
        if self.square <= 0:
            raise DimensionError(f"`background.square` must be positive, got {self.square}")
        for name in ("white", "gray"):
            v = getattr(self, name)
            if not 0 <= v <= 255:
                raise MalformedEnvelope(f"`background.{name}` must be in 0..255, got {v}")


class ResizePlan(msgspec.Struct, frozen=True, kw_only=True):
    """The NaViT resize plan of one image (see ``mmwire.materialize.plan_resize``)."""

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    grid: Grid
    tokens: int

    def __post_init__(self) -> None:
        for name in ("width", "height", "new_width", "new_height"):
            v = getattr(self, name)
            if v <= 0:
                raise DimensionError(f"`plan.{name}` must be positive, got {v}")
        _non_negative("plan", pad_width=self.pad_width, pad_height=self.pad_height)
        if self.tokens <= 0:
            raise DimensionError(f"`plan.tokens` must be positive, got {self.tokens}")

    @property
    def padded_width(self) -> int:
        """Canvas width after padding."""
        return self.new_width + self.pad_width

    @property
    def padded_height(self) -> int:
        """Canvas height after padding."""
        return self.new_height + self.pad_height


_MAX_PATCH = 64
_MAX_MERGE = 8
_MAX_TEMPORAL = 8
_MAX_ABS_MEAN = 1e3
_STD_RANGE = (1e-6, 1e3)


def _check_values(
    where: str, mean: tuple[float, ...], std: tuple[float, ...], rescale: float
) -> None:
    """Normalisation constants a pipeline can run: means finite and bounded, stds neither
    zero nor huge, the rescale factor in (0, 1]."""
    for m in mean:
        if not (math.isfinite(m) and abs(m) <= _MAX_ABS_MEAN):
            raise MalformedEnvelope(
                f"`{where}.image_mean` must be finite within ±{_MAX_ABS_MEAN:g}, got {list(mean)}"
            )
    lo, hi = _STD_RANGE
    for s in std:
        if not (math.isfinite(s) and lo <= s <= hi):
            raise MalformedEnvelope(
                f"`{where}.image_std` must be in [{lo:g}, {hi:g}], got {list(std)}"
            )
    if not (math.isfinite(rescale) and 0 < rescale <= 1):
        raise MalformedEnvelope(f"`{where}.rescale_factor` must be in (0, 1], got {rescale}")


class PanAndScan(msgspec.Struct, frozen=True, array_like=True):
    """Gemma 3's pan-and-scan: an image wider or taller than ``min_ratio`` also gets up to
    ``max_crops`` side-by-side crops of at least ``min_crop`` pixels a side, each resized
    like the whole image (``Gemma3ImageProcessor.pan_and_scan``)."""

    min_crop: int
    max_crops: int
    min_ratio: float

    def __post_init__(self) -> None:
        if not 0 < self.min_crop <= MAX_WHOLE_SIDE:
            raise DimensionError(
                f"`pan_and_scan.min_crop` must be in 1..{MAX_WHOLE_SIDE}, got {self.min_crop}"
            )
        if not 0 < self.max_crops <= MAX_CROPS:
            raise DimensionError(
                f"`pan_and_scan.max_crops` must be in 1..{MAX_CROPS}, got {self.max_crops}"
            )
        if not (math.isfinite(self.min_ratio) and 0 < self.min_ratio <= 1e6):
            raise MalformedEnvelope(
                f"`pan_and_scan.min_ratio` must be finite and positive, got {self.min_ratio}"
            )


class PreprocessSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the owner needs to turn a raw item into model inputs.

    ``processor`` names the reference semantics (see :data:`Processor`); the fields after it
    are that processor's parameters, the others keep their defaults.

    * ``kimi_vl``: ``background`` ``None`` means alpha is dropped after the resize (K2.5);
      see :class:`Background` for K3. ``in_patch_limit``, ``patch_limit_on_one_side`` and
      ``fixed_output_tokens`` are the checkpoint's plan limits.
    * ``gemma3``: the image is resized (BILINEAR) to the plan's ``new_width x new_height``
      with no padding and becomes one row ``(3, H, W)``, followed by one row for each
      ``pan_and_scan`` crop (grid ``(1 + crops, 1, 1)``); values as for ``qwen2_vl``, and
      transparency likewise composited over white on the producer.
    * ``internvl``: ``tile`` is one tile's ``(height, width)`` and ``tiles`` the least and
      most tiles; the image is resized (BICUBIC) to the plan's ``new_width x new_height``, a
      grid of whole tiles of the aspect ratio closest to the image's, cut into rows
      ``(3, h, w)`` left to right, top to bottom, then, with more than one tile, the whole
      image resized to one tile (the thumbnail): grid ``(tiles + thumbnail, 1, 1)``. Values
      and transparency as for ``gemma3``.
    * ``qwen2_vl`` and ``glm4v``: ``min_pixels``/``max_pixels`` bound ``smart_resize``'s
      target (each family's own: GLM's counts two frames and enlarges sides under one
      merge window first), every
      patch is repeated ``temporal_patch_size`` times in its row, and bytes become values as
      ``float32(v · rescale_factor)`` then ``(x - mean) / std`` in float32. Transparency is
      composited over white on the producer, so raw items carry 1 or 3 channels; there is
      no padding.

    The owner recomputes ``plan`` from the image's size and these limits and refuses a plan
    that differs, so an envelope cannot ask for more work than its checkpoint allows.
    """

    plan: ResizePlan
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    background: Background | None = None
    patch_size: int = 14
    merge_kernel: tuple[int, int] = (2, 2)
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    processor: Processor = "kimi_vl"
    min_pixels: int | None = None
    max_pixels: int | None = None
    temporal_patch_size: int = 1
    rescale_factor: float = 1 / 255
    tile: tuple[int, int] | None = None
    tiles: tuple[int, int] = (1, 1)
    pan_and_scan: PanAndScan | None = None

    @property
    def alpha(self) -> Literal["keep", "white"]:
        """How the producer treats transparency (``mmwire.transport.images.to_pixels``): ``keep``
        it for the owner (Kimi), or composite it over ``white`` first (Qwen-VL)."""
        return "white" if self.follows_transformers else "keep"

    @property
    def follows_transformers(self) -> bool:
        """Whether values follow transformers' Pillow backend: ``float32(v · rescale_factor)``
        (the product in float64), then ``(x - mean) / std`` in float32."""
        return self.processor in TRANSFORMERS_PROCESSORS

    @property
    def windowed(self) -> bool:
        """Whether the rows are Qwen-VL's: flat, by merge window, each patch repeated
        ``temporal_patch_size`` times, transformers' float32 normalisation."""
        return self.processor in WINDOWED_PROCESSORS

    @property
    def merge_order(self) -> int:
        """0: patches row-major over the grid; ``m``: ordered by ``m x m`` merge windows."""
        return self.merge_kernel[0] if self.windowed else 0

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One patch's row of ``pixel_values``: ``(3, p, p)`` or ``(3·T·p·p,)``."""
        p = self.patch_size
        if self.windowed:
            return (3 * self.temporal_patch_size * p * p,)
        if self.processor == "gemma3":
            return (3, self.plan.new_height, self.plan.new_width)
        if self.processor == "internvl" and self.tile is not None:
            return (3, *self.tile)
        return (3, p, p)

    def __post_init__(self) -> None:
        if not 0 < self.patch_size <= _MAX_PATCH:
            raise DimensionError(
                f"`preprocess.patch_size` must be in 1..{_MAX_PATCH}, got {self.patch_size}"
            )
        if not all(0 < m <= _MAX_MERGE for m in self.merge_kernel):
            raise DimensionError(
                f"`preprocess.merge_kernel` must be in 1..{_MAX_MERGE}, "
                f"got {list(self.merge_kernel)}"
            )
        for name, limit in (
            ("in_patch_limit", self.in_patch_limit),
            ("patch_limit_on_one_side", self.patch_limit_on_one_side),
            ("fixed_output_tokens", self.fixed_output_tokens or 1),
        ):
            if limit <= 0:
                raise DimensionError(f"`preprocess.{name}` must be positive, got {limit}")
        _check_values("preprocess", self.image_mean, self.image_std, self.rescale_factor)
        if self.windowed:
            self._check_windowed()
        elif (self.temporal_patch_size, self.min_pixels, self.max_pixels) != (1, None, None):
            raise MalformedEnvelope(
                "`preprocess.temporal_patch_size`, `min_pixels` and `max_pixels` belong to "
                "the qwen2_vl and glm4v processors"
            )
        if (self.tile, self.tiles) != (None, (1, 1)) and self.processor != "internvl":
            raise MalformedEnvelope(
                "`preprocess.tile` and `tiles` belong to the internvl processor"
            )
        if self.pan_and_scan is not None and self.processor != "gemma3":
            raise MalformedEnvelope("`preprocess.pan_and_scan` belongs to the gemma3 processor")
        if self.processor == "gemma3":
            self._check_whole()
            return
        if self.processor == "internvl":
            self._check_tiled()
            return
        p = self.patch_size
        plan = self.plan
        if plan.padded_width % p or plan.padded_height % p:
            raise GridMismatch(
                f"`preprocess.plan` canvas {plan.padded_width}x{plan.padded_height} is not a "
                f"multiple of patch_size {p}"
            )
        expected = (plan.padded_height // p, plan.padded_width // p)
        if (plan.grid.h, plan.grid.w) != expected:
            raise GridMismatch(
                f"`preprocess.plan.grid` {list(plan.grid.dims)} disagrees with the canvas "
                f"{plan.padded_width}x{plan.padded_height} (expected h, w = {list(expected)})"
            )

    def _check_transformers_values(self) -> None:
        name = self.processor
        if self.background is not None:
            raise MalformedEnvelope(
                f"{name} composites over white on the producer: no `background`"
            )

    def _check_tiled(self) -> None:
        """An ``internvl`` spec: tiles of bounded size, a canvas of whole tiles within
        ``tiles``, and one row a tile plus the thumbnail's."""
        self._check_transformers_values()
        plan, lo, hi = self.plan, *self.tiles
        if self.tile is None or not all(0 < side <= MAX_WHOLE_SIDE for side in self.tile):
            raise DimensionError(
                f"an internvl spec needs `tile` sides in 1..{MAX_WHOLE_SIDE}, got {self.tile}"
            )
        if not 1 <= lo <= hi <= MAX_TILES:
            raise DimensionError(
                f"an internvl spec needs 1 <= `tiles` <= {MAX_TILES}, got {list(self.tiles)}"
            )
        th, tw = self.tile
        rows, cols = plan.new_height // th, plan.new_width // tw
        n = rows * cols
        if plan.new_height % th or plan.new_width % tw or not lo <= n <= hi:
            raise GridMismatch(
                f"an internvl canvas is {lo} to {hi} whole {tw}x{th} tiles, got "
                f"{plan.new_width}x{plan.new_height}"
            )
        want = (n + (n > 1), 1, 1)
        if plan.pad_width or plan.pad_height or plan.grid.thw != want:
            raise GridMismatch(
                f"an internvl plan of {n} tiles has grid {list(want)} and no padding, got "
                f"{list(plan.grid.thw)} padded by {plan.pad_width}x{plan.pad_height}"
            )

    def _check_whole(self) -> None:
        """A ``gemma3`` spec: one unpadded target of bounded size, one row for the image and
        one a pan-and-scan crop, rescale in range."""
        plan = self.plan
        self._check_transformers_values()
        if max(plan.new_width, plan.new_height) > MAX_WHOLE_SIDE:
            raise DimensionError(
                f"a gemma3 target is at most {MAX_WHOLE_SIDE} a side, got "
                f"{plan.new_width}x{plan.new_height}"
            )
        crops = 0 if self.pan_and_scan is None else self.pan_and_scan.max_crops
        t, h, w = plan.grid.thw
        if plan.pad_width or plan.pad_height or (h, w) != (1, 1) or not 1 <= t <= 1 + crops:
            raise GridMismatch(
                f"a gemma3 plan is one unpadded row and one a crop (at most {crops}), got grid "
                f"{list(plan.grid.thw)} padded by {plan.pad_width}x{plan.pad_height}"
            )

    def _check_windowed(self) -> None:
        mh, mw = self.merge_kernel
        name = self.processor
        if mh != mw:
            raise DimensionError(f"{name} needs a square merge kernel, got {[mh, mw]}")
        if not 0 < self.temporal_patch_size <= _MAX_TEMPORAL:
            raise DimensionError(
                f"`preprocess.temporal_patch_size` must be in 1..{_MAX_TEMPORAL}, "
                f"got {self.temporal_patch_size}"
            )
        lo, hi = self.min_pixels, self.max_pixels
        if lo is None or hi is None or not 0 < lo <= hi:
            raise DimensionError(
                f"{name} needs 0 < `min_pixels` <= `max_pixels`, got {lo} and {hi}"
            )
        if self.background is not None:
            raise MalformedEnvelope(
                f"{name} composites over white on the producer: no `background`"
            )
        plan, f = self.plan, self.patch_size * mh
        if plan.pad_width or plan.pad_height or plan.new_width % f or plan.new_height % f:
            raise GridMismatch(
                f"a {name} plan resizes to multiples of {f} without padding, got "
                f"{plan.new_width}x{plan.new_height} padded by {plan.pad_width}x{plan.pad_height}"
            )


class EncodedImage(msgspec.Struct, frozen=True, kw_only=True):
    """What an encoded item's bytes hold, read from their header on the producer: the
    container, the size, and the channels decoding gives under the item's alpha rule. The
    owner decodes and refuses pixels that disagree (``GridMismatch``)."""

    format: EncodedFormat
    width: int
    height: int
    channels: int

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0:
            raise DimensionError(
                f"`encoding` size must be positive, got {self.width}x{self.height}"
            )
        if self.channels not in (1, 3, 4):
            raise DimensionError(f"`encoding.channels` must be 1, 3 or 4, got {self.channels}")


VideoFormat = Literal["mp4", "mov", "webm", "mkv"]
VIDEO_FORMATS: frozenset[str] = frozenset(("mp4", "mov", "webm", "mkv"))
VIDEO_CODECS: frozenset[str] = frozenset(("h264", "hevc", "vp8", "vp9", "av1"))
"""The video codecs an owner decodes (FFmpeg's names); a container holding another is
refused on the producer."""


class EncodedVideo(msgspec.Struct, frozen=True, kw_only=True):
    """What a video item's container holds, read from its header on the producer: the
    container and codec, the frame size, the frame count and the average frame rate (as
    transformers' PyAV loader reads them). The owner decodes against it and refuses
    frames that disagree (``VideoDecodeError``)."""

    format: VideoFormat
    codec: str
    width: int
    height: int
    frames: int
    fps: float

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0:
            raise DimensionError(f"video size must be positive, got {self.width}x{self.height}")
        if self.frames <= 0:
            raise DimensionError(f"a video must have frames, got {self.frames}")
        if not math.isfinite(self.fps) or self.fps <= 0:
            raise DimensionError(f"a video's frame rate must be positive, got {self.fps}")
        if self.codec not in VIDEO_CODECS:
            raise DimensionError(f"video codec {self.codec!r} is not one of {sorted(VIDEO_CODECS)}")

    @property
    def duration(self) -> float:
        """Seconds, as transformers computes them: frames / fps."""
        return self.frames / self.fps


VideoSampler = Literal["qwen2_vl", "qwen3_vl"]
"""Whose frame sampling a video follows: ``qwen2_vl`` (transformers'
``Qwen2VLVideoProcessor``, Qwen2-VL and Qwen2.5-VL) or ``qwen3_vl``
(``Qwen3VLVideoProcessor``)."""
MAX_VIDEO_SAMPLES = 16_384
"""The most frames one video's plan may sample (the checkpoints allow 768)."""
_MAX_VIDEO_FPS = 1000.0


class VideoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint's video preprocessing, as its ``video_preprocessor_config.json`` and
    call-time settings give it (``mmwire.materialize.video.video_spec_for``). Defaults are
    transformers' ``Qwen2VLVideoProcessor``'s.

    ``do_sample_frames`` off takes every frame; on, ``fps`` (or ``num_frames``) picks them
    the ``sampler``'s way, between ``min_frames`` and ``max_frames``. ``min_pixels`` and
    ``max_pixels`` bound the resized frame (the config's ``size``), ``max_decoded_bytes``
    the sampled frames as decoded RGB."""

    family: str = "qwen2.5-vl"
    sampler: VideoSampler = "qwen2_vl"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128_000
    max_decoded_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if len(self.family) > 64:
            raise MalformedEnvelope("`video.config.family` is over 64 characters")
        for name, value, most in (
            ("patch_size", self.patch_size, _MAX_PATCH),
            ("merge_size", self.merge_size, _MAX_MERGE),
            ("temporal_patch_size", self.temporal_patch_size, _MAX_TEMPORAL),
        ):
            if not 0 < value <= most:
                raise DimensionError(f"`video.config.{name}` must be in 1..{most}, got {value}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise DimensionError(
                "`video.config` needs 0 < `min_pixels` <= `max_pixels`, got "
                f"{self.min_pixels} and {self.max_pixels}"
            )
        if not 0 < self.min_frames <= self.max_frames <= MAX_VIDEO_SAMPLES:
            raise DimensionError(
                f"`video.config` needs 0 < `min_frames` <= `max_frames` <= {MAX_VIDEO_SAMPLES}, "
                f"got {self.min_frames} and {self.max_frames}"
            )
        if self.fps is not None and self.num_frames is not None:
            raise MalformedEnvelope("`video.config.fps` and `num_frames` are mutually exclusive")
        if self.fps is not None and not (
            math.isfinite(self.fps) and 0 < self.fps <= _MAX_VIDEO_FPS
        ):
            raise DimensionError(
                f"`video.config.fps` must be in (0, {_MAX_VIDEO_FPS:g}], got {self.fps}"
            )
        if self.num_frames is not None and not 0 < self.num_frames <= MAX_VIDEO_SAMPLES:
            raise DimensionError(
                f"`video.config.num_frames` must be in 1..{MAX_VIDEO_SAMPLES}, "
                f"got {self.num_frames}"
            )
        if self.max_video_tokens <= 0 or self.max_decoded_bytes <= 0:
            raise DimensionError("`video.config`'s token and byte ceilings must be positive")
        _check_values("video.config", self.image_mean, self.image_std, self.rescale_factor)

    @property
    def factor(self) -> int:
        """The side every resized frame is a multiple of: ``patch_size · merge_size``."""
        return self.patch_size * self.merge_size

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One patch's row of ``pixel_values_videos``: ``(3·T·p·p,)``."""
        return (3 * self.temporal_patch_size * self.patch_size * self.patch_size,)


class VideoPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the processor does with one video, from its header: the frames it samples
    (frame numbers, ascending), the size each is resized to, the grid ``(t, h, w)``, the
    LLM tokens and, for Qwen3-VL, each temporal patch's timestamp in seconds (its prompt's
    ``<t seconds>``)."""

    indices: tuple[int, ...]
    width: int
    height: int
    new_width: int
    new_height: int
    grid: Grid
    tokens: int
    timestamps: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("width", "height", "new_width", "new_height", "tokens"):
            if getattr(self, name) <= 0:
                raise DimensionError(f"`video.plan.{name}` must be positive")
        n = len(self.indices)
        if not 0 < n <= MAX_VIDEO_SAMPLES:
            raise DimensionError(f"`video.plan` samples 1 to {MAX_VIDEO_SAMPLES} frames, got {n}")
        if self.indices[0] < 0 or any(a > b for a, b in zip(self.indices, self.indices[1:])):
            raise MalformedEnvelope("`video.plan.indices` must be frame numbers >= 0, ascending")
        if self.grid.ndim != 3:
            raise DimensionError(f"`video.plan.grid` is [t, h, w], got {list(self.grid.dims)}")

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the sampled frames as decoded RGB."""
        return len(self.indices) * self.width * self.height * 3


class VideoSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything an owner needs to turn a video item into ``pixel_values_videos``: the
    checkpoint's video preprocessing, the video's plan under it and, for a container, its
    header (``None`` for frames that travel decoded).

    The plan must be consistent in itself (grid, tokens, timestamps against the config) and
    with the header; the owner recomputes it from the header and the config and refuses one
    that differs, so an envelope cannot ask for more frames or pixels than its checkpoint
    allows."""

    config: VideoConfig
    plan: VideoPlan
    header: EncodedVideo | None = None

    def __post_init__(self) -> None:
        c, plan = self.config, self.plan
        n = len(plan.indices)
        f, p, m = c.factor, c.patch_size, c.merge_size
        if plan.new_width % f or plan.new_height % f:
            raise GridMismatch(
                f"a video resizes to multiples of {f}, got {plan.new_width}x{plan.new_height}"
            )
        want = (-(-n // c.temporal_patch_size), plan.new_height // p, plan.new_width // p)
        if plan.grid.thw != want:
            raise GridMismatch(
                f"`video.plan.grid` {list(plan.grid.dims)}: {n} frames resized to "
                f"{plan.new_width}x{plan.new_height} make {list(want)}"
            )
        if plan.tokens != want[0] * want[1] * want[2] // (m * m):
            raise GridMismatch(f"`video.plan.tokens` {plan.tokens} disagrees with its grid")
        stamps = plan.timestamps
        if (stamps is not None) != (c.sampler == "qwen3_vl") or (
            stamps is not None and len(stamps) != want[0]
        ):
            raise MalformedEnvelope(
                "`video.plan.timestamps` has one value a temporal patch for qwen3_vl, and is "
                "nil otherwise"
            )
        if n > c.max_frames:
            raise DimensionError(f"`video.plan` samples {n} frames, over `max_frames`")
        if plan.decoded_bytes > c.max_decoded_bytes:
            raise DimensionError(
                f"`video.plan`'s sampled frames decode to {plan.decoded_bytes} bytes, over "
                f"`max_decoded_bytes` {c.max_decoded_bytes}"
            )
        h = self.header
        if h is not None:
            if (h.width, h.height) != (plan.width, plan.height):
                raise DimensionError(
                    f"a {h.width}x{h.height} video with a plan for {plan.width}x{plan.height}"
                )
            if plan.indices[-1] >= h.frames:
                raise DimensionError(
                    f"`video.plan` samples frame {plan.indices[-1]} of a {h.frames}-frame video"
                )


class FeatureEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    """One item of a batch: what it is, where its payload lives, and who reads it.

    * ``raw``: uint8 pixels ``(H, W, C)`` with C in 1/3/4 and a ``preprocess`` spec; the
      owner materialises it.
    * ``processed``: model-ready ``(patches, ...)`` features; rows must equal ``grid.patches``.
    * ``embedding``: encoder output ``(tokens, hidden)`` for disaggregated encoders.
    * ``encoded``: a raw item's compressed image ``(nbytes,)`` uint8 as the client sent it,
      with its ``encoding`` and ``preprocess`` spec; the owner decodes, then as ``raw``.

    ``consumers`` are the ranks that will map and release the payload (the item's owners);
    every other rank only reads the metadata.
    """

    version: int
    request_id: str
    index: GlobalIndex
    modality: Modality
    kind: Kind
    grid: Grid
    tensor: TensorSpec
    payload: PayloadRef
    consumers: tuple[int, ...]
    preprocess: PreprocessSpec | None = None
    digest: str | None = None
    encoding: EncodedImage | None = None
    caller_key: str | None = None
    video: VideoSpec | None = None

    def __post_init__(self) -> None:
        if self.version not in READABLE_VERSIONS:
            raise SchemaVersionError(
                f"`version` {self.version} is not readable (versions {list(READABLE_VERSIONS)})"
            )
        # every envelope a batch holds passes here, on both sides: the messages' text is
        # made only when one is raised
        if not self.consumers:
            raise MalformedEnvelope(f"`consumers` of {self._where()} must name at least one rank")
        if len(set(self.consumers)) != len(self.consumers) or min(self.consumers) < 0:
            raise MalformedEnvelope(
                f"`consumers` of {self._where()} must be distinct ranks >= 0, "
                f"got {list(self.consumers)}"
            )
        payload_len = getattr(self.payload, "length", None)
        if payload_len is not None and payload_len != self.tensor.nbytes:
            raise ByteLengthMismatch(
                f"`payload.length` {payload_len} of {self._where()} != "
                f"`tensor.nbytes` {self.tensor.nbytes}"
            )
        video = self.modality == "video" and self.kind in ("raw", "encoded")
        if video:
            self._check_video()
        elif self.video is not None:
            raise MalformedEnvelope(
                f"`video` is only allowed on raw and encoded videos ({self._where()})"
            )
        elif self.kind == "raw":
            self._check_raw()
        elif self.kind == "encoded":
            self._check_encoded()
        elif self.preprocess is not None:
            raise MalformedEnvelope(
                f"`preprocess` is only allowed on raw and encoded items ({self._where()})"
            )
        if (self.encoding is not None) != (self.kind == "encoded" and not video):
            raise MalformedEnvelope(
                f"`encoding` is required on encoded images only ({self._where()})"
            )
        if self.kind == "processed" and self.tensor.shape[0] != self.grid.patches:
            raise GridMismatch(
                f"processed tensor of {self._where()} has {self.tensor.shape[0]} rows but its grid "
                f"{list(self.grid.dims)} has {self.grid.patches} patches"
            )
        for name, value in (("digest", self.digest), ("caller_key", self.caller_key)):
            if value is not None and len(value) > 128:
                raise MalformedEnvelope(f"`{name}` of {self._where()} is over 128 characters")

    def _where(self) -> str:
        return f"item {self.index.value} of request {self.request_id!r}"

    def _check_video(self) -> None:
        """A raw or encoded video: its ``video`` spec, no image spec, and a tensor that is
        the container's bytes (encoded) or the plan's sampled frames as ``(n, H, W, 3)``."""
        spec = self.video
        if spec is None or self.preprocess is not None:
            raise MalformedEnvelope(
                f"{self.kind} video {self._where()} needs `video` and no `preprocess`"
            )
        plan = spec.plan
        if self.kind == "encoded":
            want: tuple[int, ...] = (self.tensor.shape[0],)
            if spec.header is None:
                raise MalformedEnvelope(f"encoded video {self._where()} needs `video.header`")
        else:
            want = (len(plan.indices), plan.height, plan.width, 3)
        if self.tensor.dtype != "uint8" or self.tensor.shape != want:
            raise DimensionError(
                f"{self.kind} video {self._where()} must carry uint8 {list(want)}, got "
                f"{self.tensor.dtype}{list(self.tensor.shape)}"
            )
        if plan.grid.thw != self.grid.thw:
            raise GridMismatch(
                f"`grid` {list(self.grid.dims)} of {self._where()} disagrees with its plan's grid "
                f"{list(plan.grid.dims)}"
            )

    def _check_encoded(self) -> None:
        spec, enc = self.preprocess, self.encoding
        if spec is None or enc is None:
            raise MalformedEnvelope(f"encoded {self._where()} needs `preprocess` and `encoding`")
        if self.tensor.dtype != "uint8" or len(self.tensor.shape) != 1:
            raise MalformedEnvelope(
                f"encoded {self._where()} must carry (nbytes,) uint8, got "
                f"{self.tensor.dtype}{list(self.tensor.shape)}"
            )
        if (enc.width, enc.height) != (spec.plan.width, spec.plan.height):
            raise DimensionError(
                f"encoded {self._where()} is {enc.width}x{enc.height} but its plan says "
                f"{spec.plan.width}x{spec.plan.height}"
            )
        if enc.channels == 4 and spec.alpha == "white":
            raise DimensionError(
                f"encoded {self._where()} declares RGBA, but its processor composites transparency "
                "over white: 1 or 3 channels"
            )
        if spec.plan.grid.thw != self.grid.thw:
            raise GridMismatch(
                f"`grid` {list(self.grid.dims)} of {self._where()} disagrees with its plan's grid "
                f"{list(spec.plan.grid.dims)}"
            )

    def _check_raw(self) -> None:
        spec = self.preprocess
        if spec is None:
            raise MalformedEnvelope(f"raw {self._where()} needs a `preprocess` spec")
        if self.tensor.dtype != "uint8":
            raise MalformedEnvelope(
                f"raw {self._where()} must carry uint8 pixels, "
                f"got `tensor.dtype` {self.tensor.dtype!r}"
            )
        shape = self.tensor.shape
        if len(shape) != 3 or shape[2] not in (1, 3, 4):
            raise DimensionError(
                f"raw {self._where()} must be (H, W, C) with C in 1/3/4, got {list(shape)}"
            )
        if shape[2] == 4 and spec.alpha == "white":
            raise DimensionError(
                f"raw {self._where()} is RGBA, but its processor composites transparency over "
                "white on the producer: 1 or 3 channels"
            )
        if (shape[1], shape[0]) != (spec.plan.width, spec.plan.height):
            raise DimensionError(
                f"raw {self._where()} is {shape[1]}x{shape[0]} but its plan says "
                f"{spec.plan.width}x{spec.plan.height}"
            )
        if spec.plan.grid.thw != self.grid.thw:
            raise GridMismatch(
                f"`grid` {list(self.grid.dims)} of {self._where()} disagrees with its plan's grid "
                f"{list(spec.plan.grid.dims)}"
            )


class _Header(msgspec.Struct, frozen=True, kw_only=True):
    """The header frame of a batch: the envelopes and how many inline frames follow."""

    version: int
    envelopes: tuple[FeatureEnvelope, ...]
    frames: int


class _VersionProbe(msgspec.Struct):
    """Reads only ``version`` so an incompatible header gets a precise error."""

    version: int
