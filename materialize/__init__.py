"""mmwire.materialize: the owner side: resize plans, deferral, owner assignment, pixels -> features.

General layout: ``_families`` (the model families and ``spec_for``), ``_plan`` (the resize
plans: Kimi's NaViT plan, Qwen-VL's ``smart_resize``), ``_grids`` (grid/token arithmetic),
``_placeholders``, ``_defer`` (the producer's gate), ``_assign`` (vision-DP owners),
``_pipeline`` (the exact CPU pixel pipeline), ``_decode`` (an encoded item's decode at the
owner), ``_backend`` (CPU or CUDA), ``_cache`` (the owner's cache of outputs),
``_materializer`` (the owner rank's entry point). Pillow's BICUBIC tables and the normalise
table live in ``mmwire.kernels.reference``, which the CUDA kernels share; they are
re-exported here.
"""

from mmwire.kernels.reference import Coefficients as Coefficients
from mmwire.kernels.reference import bicubic_coefficients as bicubic_coefficients
from mmwire.kernels.reference import pass_order as pass_order
from mmwire.kernels.reference import resize_reference as resize_reference

from ._assign import OwnerAffinity as OwnerAffinity
from ._assign import assign_owners as assign_owners
from ._assign import owners_of as owners_of
from ._cache import CacheStatistics as CacheStatistics
from ._defer import should_defer as should_defer
from ._families import FAMILIES as FAMILIES
from ._families import ModelSpec as ModelSpec
from ._families import QwenVLConfig as QwenVLConfig
from ._families import spec_for as spec_for
from ._grids import patches_per_item as patches_per_item
from ._grids import split_by_tokens as split_by_tokens
from ._grids import tokens_per_item as tokens_per_item
from ._materializer import MaterializedBatch as MaterializedBatch
from ._materializer import Materializer as Materializer
from ._materializer import PayloadSource as PayloadSource
from ._pipeline import normalise_table as normalise_table
from ._pipeline import preprocess_images as preprocess_images
from ._placeholders import expand_placeholders as expand_placeholders
from ._placeholders import k3_media_prompt as k3_media_prompt
from ._plan import K3_BACKGROUND as K3_BACKGROUND
from ._plan import ProcessorConfig as ProcessorConfig
from ._plan import plan_resize as plan_resize
from ._plan import plan_smart_resize as plan_smart_resize
from ._plan import smart_resize as smart_resize

__all__ = [
    "FAMILIES",
    "K3_BACKGROUND",
    "CacheStatistics",
    "Coefficients",
    "MaterializedBatch",
    "Materializer",
    "ModelSpec",
    "OwnerAffinity",
    "PayloadSource",
    "ProcessorConfig",
    "QwenVLConfig",
    "assign_owners",
    "bicubic_coefficients",
    "expand_placeholders",
    "k3_media_prompt",
    "normalise_table",
    "owners_of",
    "pass_order",
    "patches_per_item",
    "plan_resize",
    "plan_smart_resize",
    "preprocess_images",
    "resize_reference",
    "should_defer",
    "smart_resize",
    "spec_for",
    "split_by_tokens",
    "tokens_per_item",
]
