"""The model families mmwire preprocesses for, and ``spec_for``: a family's spec from the
checkpoint's processor parameters (the fields of its ``preprocessor_config.json``).

A family is data plus its plan: Kimi's NaViT plan (``ProcessorConfig``) or Qwen-VL's
``smart_resize`` (``QwenVLConfig``). Both give, per image, the wire's ``PreprocessSpec``,
whose ``processor`` field tells the owner which semantics to run; the deferral gate, the
grid and token counts and the placeholder expansion all come from the spec object
(``ModelSpec``). A new family adds a config class here and, if its pixels differ, a
processor to the schema (tiling families such as InternVL would add a crop step and a
tile layout; BILINEAR ones such as Gemma 3 a filter to ``mmwire.kernels.reference``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from mmwire.transport import (
    MAX_IMAGE_PIXELS,
    Background,
    ConfigurationError,
    PreprocessSpec,
    ResizePlan,
)

from ._plan import K3_BACKGROUND, ProcessorConfig, plan_smart_resize

__all__ = [
    "FAMILIES",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ModelSpec",
    "QwenVLConfig",
    "spec_for",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor configs write it


class ModelSpec(Protocol):
    """What the producer and the owner ask of a family's spec (``spec_for``'s result)."""

    @property
    def family(self) -> str: ...

    @property
    def patch_size(self) -> int: ...

    @property
    def merge_kernel(self) -> tuple[int, int]: ...

    @property
    def max_input_pixels(self) -> int: ...

    @property
    def alpha(self) -> Literal["keep", "white"]: ...

    @property
    def row_shape(self) -> tuple[int, ...]: ...

    def plan(self, width: int, height: int) -> ResizePlan: ...

    def tokens(self, width: int, height: int) -> int: ...

    def spec_for(self, width: int, height: int) -> PreprocessSpec: ...

    def __call__(self, width: int, height: int) -> PreprocessSpec: ...


@dataclass(frozen=True)
class QwenVLConfig:
    """A Qwen-VL checkpoint's image preprocessing (transformers' ``Qwen2VLImageProcessor``,
    shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL). Defaults: the Qwen2.5-VL checkpoints'."""

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
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.MAX_IMAGE_PIXELS``)."""

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

    def spec_for(self, width: int, height: int) -> PreprocessSpec:
        """The preprocessing spec of one ``width x height`` image under this config."""
        return PreprocessSpec(
            plan=self.plan(width, height),
            image_mean=self.image_mean,
            image_std=self.image_std,
            patch_size=self.patch_size,
            merge_kernel=self.merge_kernel,
            processor="qwen2_vl",
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            temporal_patch_size=self.temporal_patch_size,
            rescale_factor=self.rescale_factor,
        )

    def __call__(self, width: int, height: int) -> PreprocessSpec:
        """``spec_for``: a config is usable as ``Item(preprocess=config)``."""
        return self.spec_for(width, height)


_QWEN3 = QwenVLConfig(
    family="qwen3-vl",
    patch_size=16,
    min_pixels=65_536,
    max_pixels=16_777_216,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)

FAMILIES: dict[str, ProcessorConfig | QwenVLConfig] = {
    "kimi-k2.5": ProcessorConfig(),
    "kimi-k3": ProcessorConfig(in_patch_limit=65536, background=K3_BACKGROUND, family="kimi-k3"),
    "qwen2-vl": QwenVLConfig(family="qwen2-vl"),
    "qwen2.5-vl": QwenVLConfig(),
    "qwen3-vl": _QWEN3,
}
"""Each family's spec with its checkpoints' defaults."""

# preprocessor_config.json keys that do not change an image's pixels or grid
_IGNORED = frozenset(
    {
        "image_processor_type",
        "processor_class",
        "auto_map",
        "feature_extractor_type",
        "video_processor_type",
        "do_sample_frames",
        "fps",
        "min_frames",
        "max_frames",
        "num_frames",
        "return_metadata",
        "input_data_format",
        "data_format",
        "return_tensors",
        "device",
        "default_to_square",
        "disable_grouping",
        "image_seq_length",
        "model_type",
    }
)


def spec_for(
    family: str, params: Mapping[str, Any] | None = None
) -> ProcessorConfig | QwenVLConfig:
    """The spec of ``family`` (a key of :data:`FAMILIES`) for a checkpoint whose processor
    parameters are ``params`` (its ``preprocessor_config.json`` as a dict; omitted keys keep
    the family's defaults). The result is callable as ``Item(preprocess=spec)``.

    Raises ``ConfigurationError`` for an unknown family, a key the family does not read, or
    a value mmwire cannot reproduce exactly (a filter other than BICUBIC, a step turned
    off), rather than preprocessing differently from the checkpoint.
    """
    base = FAMILIES.get(family)
    if base is None:
        raise ConfigurationError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    given = {k: v for k, v in (params or {}).items() if k not in _IGNORED}
    try:
        if isinstance(base, QwenVLConfig):
            return _qwen(base, given)
        return _kimi(base, given)
    except ConfigurationError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigurationError(f"{family}: bad processor parameters: {e}") from e


def _required(given: dict[str, Any], key: str, want: object, why: str) -> None:
    if key in given and given.pop(key) != want:
        raise ConfigurationError(f"`{key}` must be {want!r}: {why}")


def _triple(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    a, b, c = (float(v) for v in value)
    return (a, b, c)


def _take(
    given: dict[str, Any], out: dict[str, Any], keys: Mapping[str, Callable[[Any], Any]]
) -> None:
    for key, convert in keys.items():
        if key in given:
            out[key] = convert(given.pop(key))


def _leftover(given: dict[str, Any]) -> None:
    if given:
        raise ConfigurationError(
            f"processor parameters {sorted(given)} are not read by this family: mmwire would "
            "preprocess without them"
        )


def _qwen(base: QwenVLConfig, given: dict[str, Any]) -> QwenVLConfig:
    """transformers' precedence: ``size`` (pixel counts named ``shortest_edge`` and
    ``longest_edge``), then top-level ``min_pixels``/``max_pixels`` over it."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        _required(given, key, True, "mmwire runs the reference's every step")
    _required(given, "resample", _BICUBIC, "the kernels reproduce Pillow's BICUBIC")
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
    _take(
        given,
        out,
        {
            "min_pixels": int,
            "max_pixels": int,
            "patch_size": int,
            "temporal_patch_size": int,
            "merge_size": int,
            "image_mean": _triple,
            "image_std": _triple,
            "rescale_factor": float,
        },
    )
    _leftover(given)
    return replace(base, **out)


def _kimi(base: ProcessorConfig, given: dict[str, Any]) -> ProcessorConfig:
    """Kimi's keys; ``merge_kernel_size`` may be a pair (square only); ``background`` a
    dict of :class:`Background`'s fields (or ``None``)."""
    out: dict[str, Any] = {}
    if "merge_kernel_size" in given:
        merge = given.pop("merge_kernel_size")
        if isinstance(merge, (list, tuple)):
            if len(set(merge)) != 1:
                raise ConfigurationError(f"a square merge kernel is needed, got {merge}")
            merge = merge[0]
        out["merge_kernel_size"] = int(merge)
    if "background" in given:
        bg = given.pop("background")
        out["background"] = bg if bg is None or isinstance(bg, Background) else Background(**bg)
    _take(
        given,
        out,
        {
            "patch_size": int,
            "in_patch_limit": int,
            "patch_limit_on_one_side": int,
            "fixed_output_tokens": lambda v: None if v is None else int(v),
            "image_mean": _triple,
            "image_std": _triple,
        },
    )
    _leftover(given)
    return replace(base, **out)
