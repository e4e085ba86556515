"""transformers' own image processors (Pillow backend), the oracle for the families they
cover. Only the tests import transformers; mmwire never does.

The checkout's ``kernels/`` folder (``mmwire.kernels`` once installed) has the name of the
Hugging Face ``kernels`` package that transformers imports, and pytest puts the checkout on
``sys.path``; so transformers is imported here with the checkout left out of the path,
which caches the right ``kernels`` for every later import.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _without_checkout() -> Iterator[None]:
    """``sys.path`` without the checkout, for importing transformers (see above)."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
    try:
        yield
    finally:
        sys.path[:] = saved


def _import_pil_processors() -> tuple[Any, Any, Any, Any]:
    with _without_checkout():
        from transformers import Qwen2VLImageProcessorPil

        try:  # GLM's, Gemma's and InternVL's Pillow backends are newer; a machine may lack them
            from transformers import Glm4vImageProcessorPil
        except ImportError:
            Glm4vImageProcessorPil = None
        try:
            from transformers import Gemma3ImageProcessorPil, GotOcr2ImageProcessorPil
        except ImportError:
            Gemma3ImageProcessorPil = GotOcr2ImageProcessorPil = None
        return (
            Qwen2VLImageProcessorPil,
            Glm4vImageProcessorPil,
            Gemma3ImageProcessorPil,
            GotOcr2ImageProcessorPil,
        )


(
    Qwen2VLImageProcessorPil,
    Glm4vImageProcessorPil,
    Gemma3ImageProcessorPil,
    GotOcr2ImageProcessorPil,
) = _import_pil_processors()

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


GEMMA_PARAMS: dict[str, dict[str, Any]] = {
    # google/gemma-3-4b-it's preprocessor_config.json, as published
    "gemma-3": {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": 256,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 896, "width": 896},
    },
    # a smaller target, not square, with ImageNet statistics: every field is read
    "gemma3": {
        "do_pan_and_scan": False,
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
        "image_seq_length": 64,
        "resample": 2,
        "size": {"height": 224, "width": 320},
    },
}


INTERNVL_PARAMS: dict[str, dict[str, Any]] = {
    # OpenGVLab/InternVL3-8B-hf's preprocessor_config.json, as published
    "internvl3": {
        "crop_size": None,
        "crop_to_patches": True,
        "data_format": "channels_first",
        "default_to_square": True,
        "device": None,
        "do_center_crop": None,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.485, 0.456, 0.406],
        "image_processor_type": "GotOcr2ImageProcessorFast",
        "image_std": [0.229, 0.224, 0.225],
        "input_data_format": None,
        "max_patches": 12,
        "min_patches": 1,
        "processor_class": "InternVLProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "return_tensors": None,
        "size": {"height": 448, "width": 448},
    },
    # small tiles, 2 to 6 of them, CLIP statistics: every field is read
    "internvl3.5": {
        "crop_to_patches": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_patches": 6,
        "min_patches": 2,
        "resample": 3,
        "size": {"height": 56, "width": 84},
    },
}
_NOT_PROCESSOR_KWARGS = (
    "image_processor_type",
    "processor_class",
    "image_seq_length",
    "crop_size",
    "do_center_crop",
    "data_format",
    "default_to_square",
    "device",
    "input_data_format",
    "return_tensors",
)


def _pil_processor(cls: Any, name: str, params: dict[str, Any]) -> Any:
    """``cls`` (a Pillow-backend class, ``None`` where this transformers lacks it: skip)
    built from a checkpoint's ``params``, less the keys that are not its kwargs."""
    if cls is None:
        import pytest

        pytest.skip(f"this transformers has no {name}")
    return cls(**{k: v for k, v in params.items() if k not in _NOT_PROCESSOR_KWARGS})


def _rows_and_counts(
    processor: Any, images: Sequence[Any], counts: str, dtype: torch.dtype
) -> tuple[torch.Tensor, list[int]]:
    """``processor``'s ``pixel_values`` (fp32, rounded once to ``dtype``) and its per-image
    ``counts`` key."""
    got = processor(list(images), return_tensors="np")
    pixel_values = torch.from_numpy(np.ascontiguousarray(got["pixel_values"]))
    assert pixel_values.dtype == torch.float32
    return pixel_values.to(dtype), [int(n) for n in got[counts]]


def internvl_processor(params: dict[str, Any]) -> Any:
    """transformers' Pillow ``GotOcr2ImageProcessor`` built from checkpoint ``params``."""
    return _pil_processor(GotOcr2ImageProcessorPil, "GotOcr2ImageProcessorPil", params)


def internvl_reference(
    images: Sequence[Any], params: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[int]]:
    """``(pixel_values, num_patches)`` from transformers' Pillow ``GotOcr2ImageProcessor``
    (InternVL's), the fp32 values rounded once to ``dtype``."""
    return _rows_and_counts(internvl_processor(params), images, "num_patches", dtype)


def gemma_reference(
    images: Sequence[Any], params: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[int]]:
    """``(pixel_values, num_crops)`` from transformers' Pillow processor of Gemma 3, the fp32
    values rounded once to ``dtype``."""
    params = dict(params)
    if params.get("do_pan_and_scan"):  # Gemma3Processor's defaults for what the config leaves null
        defaults = {
            "pan_and_scan_min_crop_size": 256,
            "pan_and_scan_max_num_crops": 4,
            "pan_and_scan_min_ratio_to_activate": 1.2,
        }
        params.update({k: v for k, v in defaults.items() if params.get(k) is None})
    if params.get("do_convert_rgb", False) is None:
        # the published config's null reaches transformers as "don't convert", and it then
        # refuses 1- and 4-channel images; engines hand it RGB (vLLM converts every image
        # first), as its class default (convert) does
        del params["do_convert_rgb"]
    processor = _pil_processor(Gemma3ImageProcessorPil, "Gemma3ImageProcessorPil", params)
    return _rows_and_counts(processor, images, "num_crops", dtype)


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


def video_oracle() -> Any:
    """transformers' video side: ``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``,
    ``Qwen3VLProcessor`` (its timestamps), ``VideoMetadata`` and ``read_video_pyav`` (the
    PyAV loader), as a namespace. Needs torchvision (the processors resize with it)."""
    import types

    with _without_checkout():
        from transformers import (
            Qwen2VLVideoProcessor,
            Qwen3VLProcessor,
            Qwen3VLVideoProcessor,
        )
        from transformers.video_utils import VideoMetadata, read_video_pyav
    return types.SimpleNamespace(
        Qwen2VLVideoProcessor=Qwen2VLVideoProcessor,
        Qwen3VLVideoProcessor=Qwen3VLVideoProcessor,
        Qwen3VLProcessor=Qwen3VLProcessor,
        VideoMetadata=VideoMetadata,
        read_video_pyav=read_video_pyav,
    )


VIDEO_PARAMS: dict[str, dict[str, Any]] = {
    # Qwen2.5-VL checkpoints publish no video_preprocessor_config.json: transformers' video
    # processor reads their preprocessor_config.json, pixel limits included
    "qwen2.5-vl": QWEN_PARAMS["qwen2.5-vl"],
    # a Qwen3-VL checkpoint's video_preprocessor_config.json
    "qwen3-vl": {
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "video_processor_type": "Qwen3VLVideoProcessor",
    },
}
