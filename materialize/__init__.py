"""mmwire.materialize: the owner side: resize plans, deferral, owner assignment, pixels -> features.

A family's spec (``spec_for``) is one object, passed as ``preprocess=`` everywhere: to
``Item``, ``preprocess_images``, ``should_defer`` and ``Materializer``; called with an
image's size it gives that image's ``PreprocessSpec``. Errors are ``errors`` (the same
namespace as ``mmwire.transport.errors``); Pillow's BICUBIC tables live in
``mmwire.kernels.reference``, which the CUDA kernels share.

General layout: ``_families`` (the model families and ``spec_for``), one module per family
(``_kimi``: Kimi's NaViT plan and ``KimiConfig``; ``_qwen``: ``smart_resize`` and
``QwenVLConfig``; ``_glm``: ``Glm4vConfig``; ``_gemma``: ``Gemma3Config``; ``_internvl``:
``InternVLConfig``), ``_params`` (reading a checkpoint's processor parameters), ``_plan``
(the plan a received spec must have), ``_grids`` (grid/token arithmetic), ``_placeholders``,
``_defer`` (the producer's gate), ``_assign`` (vision-DP owners), ``_pipeline`` (the exact
CPU pixel pipeline), ``_regions`` (the regions InternVL and Gemma 3 cut an image into),
``_decode`` (an encoded item's decode at the owner), ``_video`` (Qwen-VL video: plan and
pixels, public as ``mmwire.materialize.video``), ``_compute`` (CPU or CUDA), ``_cache``
(the owner's cache of outputs), ``_materializer`` (the owner rank's entry point).
"""

from mmwire.transport import errors as errors

from ._assign import OwnerAffinity as OwnerAffinity
from ._assign import assign_owners as assign_owners
from ._assign import owners_of as owners_of
from ._cache import CacheStatistics as CacheStatistics
from ._defer import should_defer as should_defer
from ._families import FAMILIES as FAMILIES
from ._families import ModelSpec as ModelSpec
from ._families import spec_for as spec_for
from ._gemma import Gemma3Config as Gemma3Config
from ._gemma import gemma3_image_prompt as gemma3_image_prompt
from ._glm import Glm4vConfig as Glm4vConfig
from ._grids import patches_per_item as patches_per_item
from ._grids import split_by_tokens as split_by_tokens
from ._grids import tokens_per_item as tokens_per_item
from ._internvl import InternVLConfig as InternVLConfig
from ._internvl import internvl_image_prompt as internvl_image_prompt
from ._kimi import K3_BACKGROUND as K3_BACKGROUND
from ._kimi import KimiConfig as KimiConfig
from ._kimi import plan_resize as plan_resize
from ._materializer import MaterializedBatch as MaterializedBatch
from ._materializer import Materializer as Materializer
from ._materializer import PayloadSource as PayloadSource
from ._pipeline import preprocess_images as preprocess_images
from ._placeholders import expand_placeholders as expand_placeholders
from ._placeholders import k3_media_prompt as k3_media_prompt
from ._qwen import QwenVLConfig as QwenVLConfig
from ._qwen import plan_smart_resize as plan_smart_resize
from ._qwen import smart_resize as smart_resize
from ._regions import regions_of as regions_of

__all__ = [
    "FAMILIES",
    "K3_BACKGROUND",
    "CacheStatistics",
    "Gemma3Config",
    "Glm4vConfig",
    "InternVLConfig",
    "KimiConfig",
    "MaterializedBatch",
    "Materializer",
    "ModelSpec",
    "OwnerAffinity",
    "PayloadSource",
    "QwenVLConfig",
    "assign_owners",
    "errors",
    "expand_placeholders",
    "gemma3_image_prompt",
    "internvl_image_prompt",
    "k3_media_prompt",
    "owners_of",
    "patches_per_item",
    "plan_resize",
    "plan_smart_resize",
    "preprocess_images",
    "regions_of",
    "should_defer",
    "smart_resize",
    "spec_for",
    "split_by_tokens",
    "tokens_per_item",
]
