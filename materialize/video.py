"""Qwen-VL video on the owner side: a family's video preprocessing (``video_spec_for``), a
video's plan from its header (``QwenVideoConfig.plan``) and ``pixel_values_videos`` from
the sampled frames (``video_pixel_values``), equal to transformers' video processors.
The containers themselves are read and decoded by ``mmwire.transport.videos``."""

from ._video import MAX_DECODED_BYTES as MAX_DECODED_BYTES
from ._video import VIDEO_FAMILIES as VIDEO_FAMILIES
from ._video import QwenVideoConfig as QwenVideoConfig
from ._video import video_pixel_values as video_pixel_values
from ._video import video_spec_for as video_spec_for

__all__ = [
    "MAX_DECODED_BYTES",
    "VIDEO_FAMILIES",
    "QwenVideoConfig",
    "video_pixel_values",
    "video_spec_for",
]
