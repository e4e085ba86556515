"""The model families mmwire preprocesses for, and ``spec_for``: a family's spec from the
checkpoint's processor parameters (the fields of its ``preprocessor_config.json``).

Each family has a module of its own holding its plan and its config class: ``_kimi``
(``KimiConfig``, the NaViT plan), ``_qwen`` (``QwenVLConfig``, ``smart_resize``) and
``_glm`` (``Glm4vConfig``: Qwen-VL's pixels under GLM's own ``smart_resize``) and
``_gemma`` (``Gemma3Config``: the whole image at one fixed size, BILINEAR) and ``_internvl``
(``InternVLConfig``: tiles of 448 and a thumbnail). A
config called with an image's size gives the wire's ``PreprocessSpec``, whose ``processor``
field tells the owner which semantics to run; the deferral gate, the grid and token counts
and the placeholder expansion all come from the config (``ModelSpec``). A new family adds a
module with its config and, if its pixels differ, a processor to the schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

from mmwire.transport import PreprocessSpec, ResizePlan
from mmwire.transport.errors import ConfigurationError

from ._gemma import Gemma3Config, gemma3_config
from ._glm import Glm4vConfig, glm_config
from ._internvl import InternVLConfig, internvl_config
from ._kimi import K3_BACKGROUND, KimiConfig, kimi_config
from ._qwen import QwenVLConfig, qwen_config

__all__ = ["FAMILIES", "ModelSpec", "spec_for"]


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

    def __call__(self, width: int, height: int) -> PreprocessSpec: ...


_QWEN3 = QwenVLConfig(
    family="qwen3-vl",
    patch_size=16,
    min_pixels=65_536,
    max_pixels=16_777_216,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)

FamilySpec = KimiConfig | QwenVLConfig | Gemma3Config | InternVLConfig
"""Any family's spec: what ``spec_for`` returns."""

FAMILIES: dict[str, FamilySpec] = {
    "kimi-k2.5": KimiConfig(),
    "kimi-k3": KimiConfig(in_patch_limit=65536, background=K3_BACKGROUND, family="kimi-k3"),
    "qwen2-vl": QwenVLConfig(family="qwen2-vl"),
    "qwen2.5-vl": QwenVLConfig(),
    "qwen3-vl": _QWEN3,
    "glm-4v": Glm4vConfig(),
    "glm-4.1v": Glm4vConfig(family="glm-4.1v"),
    "glm-4.5v": Glm4vConfig(family="glm-4.5v"),
    "glm-4.6v": Glm4vConfig(family="glm-4.6v"),
    "gemma-3": Gemma3Config(),
    "gemma3": Gemma3Config(family="gemma3"),
    "internvl3": InternVLConfig(),
    "internvl3.5": InternVLConfig(family="internvl3.5"),
    "internvl2.5": InternVLConfig(family="internvl2.5"),
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


def spec_for(family: str, params: Mapping[str, Any] | None = None) -> FamilySpec:
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
    # Gemma's token count is its config's image_seq_length; other families ignore the key
    kept = {"image_seq_length"} if isinstance(base, Gemma3Config | InternVLConfig) else set()
    given = {k: v for k, v in (params or {}).items() if k not in _IGNORED - kept}
    try:
        if isinstance(base, Gemma3Config):
            return gemma3_config(base, given)
        if isinstance(base, InternVLConfig):
            return internvl_config(base, given)
        if isinstance(base, Glm4vConfig):
            return glm_config(base, given)
        if isinstance(base, QwenVLConfig):
            return qwen_config(base, given)
        return kimi_config(base, given)
    except ConfigurationError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigurationError(f"{family}: bad processor parameters: {e}") from e
