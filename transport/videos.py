"""The video input contract: the containers a video item may be (MP4, MOV, WebM,
Matroska with H.264, HEVC, VP8, VP9 or AV1), the header the producer reads of them
(``probe_video``), the owner's decode of the frames a plan samples (``decode_frames``),
with PyAV (the ``video`` extra), and what a video envelope carries (``VideoSpec``: the
checkpoint's ``VideoConfig`` and the video's ``VideoPlan``)."""

from ._schema import VIDEO_CODECS as VIDEO_CODECS
from ._schema import VIDEO_FORMATS as VIDEO_FORMATS
from ._schema import VideoConfig as VideoConfig
from ._schema import VideoPlan as VideoPlan
from ._schema import VideoSpec as VideoSpec
from ._video import MAX_FRAME_PIXELS as MAX_FRAME_PIXELS
from ._video import MAX_VIDEO_FRAMES as MAX_VIDEO_FRAMES
from ._video import decode_frames as decode_frames
from ._video import probe_video as probe_video
from ._video import video_format as video_format

__all__ = [
    "MAX_FRAME_PIXELS",
    "MAX_VIDEO_FRAMES",
    "VIDEO_CODECS",
    "VIDEO_FORMATS",
    "VideoConfig",
    "VideoPlan",
    "VideoSpec",
    "decode_frames",
    "probe_video",
    "video_format",
]
