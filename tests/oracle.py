"""transformers' own image processors (Pillow backend), the oracle for the families they
cover. Only the tests import transformers; mmwire never does.

The checkout's ``kernels/`` folder (``mmwire.kernels`` once installed) has the name of the
Hugging Face ``kernels`` package that transformers imports, and pytest puts the checkout on
``sys.path``; so transformers is imported here with the checkout left out of the path,
which caches the right ``kernels`` for every later import.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parent.parent


def _import_pil_processors() -> tuple[Any, Any]:
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
    try:
        from transformers import Qwen2VLImageProcessorPil

        try:  # GLM's Pillow backend is newer than Qwen's; a machine may lack it
            from transformers import Glm4vImageProcessorPil
        except ImportError:
            Glm4vImageProcessorPil = None
        return Qwen2VLImageProcessorPil, Glm4vImageProcessorPil
    finally:
        sys.path[:] = saved


Qwen2VLImageProcessorPil, Glm4vImageProcessorPil = _import_pil_processors()

QWEN_PARAMS: dict[str, dict[str, Any]] = {
    # the checkpoints' preprocessor_config.json, as published
    "qwen2-vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    },
    "qwen2.5-vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    },
    "qwen3-vl": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
}


GLM_PARAMS: dict[str, dict[str, Any]] = {
    # Glm4vImageProcessor's own defaults, as a checkpoint's config spells them
    "glm-4v": {
        "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "image_processor_type": "Glm4vImageProcessor",
        "processor_class": "Glm4vProcessor",
    },
    # a GLM-4.1V-style config with a smaller pixel budget
    "glm-4.1v": {
        "size": {"shortest_edge": 12544, "longest_edge": 9633792},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Glm4vImageProcessor",
        "processor_class": "Glm4vProcessor",
    },
}


def reference_processor(family: str, params: dict[str, Any]) -> Any:
    """transformers' Pillow-backend processor of ``family`` built from checkpoint ``params``."""
    kwargs = {
        k: v for k, v in params.items() if k not in ("image_processor_type", "processor_class")
    }
    if family.startswith("glm"):
        if Glm4vImageProcessorPil is None:
            import pytest

            pytest.skip("this transformers has no Glm4vImageProcessorPil")
        return Glm4vImageProcessorPil(**kwargs)
    return Qwen2VLImageProcessorPil(**kwargs)


def qwen_reference(
    images: Sequence[Any],
    params: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    family: str = "qwen2.5-vl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` from transformers' Pillow processor of ``family``
    (Qwen-VL's, or GLM-4V's, which shares its rows), the fp32 values rounded once to
    ``dtype`` (what a model casting its inputs sees)."""
    processor = reference_processor(family, params)
    got = processor(list(images), return_tensors="np")
    pixel_values = torch.from_numpy(np.ascontiguousarray(got["pixel_values"]))
    assert pixel_values.dtype == torch.float32
    return pixel_values.to(dtype), torch.from_numpy(got["image_grid_thw"])
