"""mmwire.kernels: CuPy raw CUDA kernels for the owner's GPU pixel pipeline.

``pixels.cu`` and the ``.cuh`` headers it includes hold the kernels: a Pillow-exact
BICUBIC resize (Q22 integer weights from the host, a uint8 intermediate, premultiplied RGBA)
fused with the background composite, zero pad, normalise and patchify (Kimi's rows, or
Qwen-VL's by merge window: a module per ``OutputLayout``), tile by tile in shared memory,
for many images of different sizes per launch; on compute capability 8.0+
the resize passes of images resized on both axes run exactly on the int8 tensor cores.
``resize`` and ``preprocess`` are the entry points; the CUDA ``Materializer`` backend uses
``preprocess_packed`` on the images it uploads, and ``preprocess_regions`` for the families
whose rows are whole tiles (InternVL, Gemma 3: BICUBIC or BILINEAR, crops read in place).
``video.cu`` holds Qwen-VL video's: torch's antialiased bicubic on uint8 frames, then rows of
temporal patches (``video_rows``).
What the kernels share with the host is set once, in Python, and passed to the compiler
(``compile_options``). CuPy is needed only to launch (``mmwire[cuda12]`` / ``mmwire[cuda13]``).
"""

from ._abi import FIELDS as FIELDS
from ._abi import KERNEL_PROCESSORS as KERNEL_PROCESSORS
from ._abi import KIMI_LAYOUT as KIMI_LAYOUT
from ._abi import KINDS as KINDS
from ._abi import RECORD_FIELDS as RECORD_FIELDS
from ._abi import OutputLayout as OutputLayout
from ._abi import compile_options as compile_options
from ._descriptors import ImageJob as ImageJob
from ._descriptors import Layout as Layout
from ._descriptors import layout_of as layout_of
from ._launch import SOURCE as SOURCE
from ._launch import CupyLauncher as CupyLauncher
from ._launch import Launcher as Launcher
from ._launch import kernel_source as kernel_source
from ._ops import output_layout as output_layout
from ._ops import pack as pack
from ._ops import preprocess as preprocess
from ._ops import preprocess_packed as preprocess_packed
from ._ops import resize as resize
from ._ops import resize_packed as resize_packed
from ._ops import to_device as to_device
from ._regions import Region as Region
from ._regions import preprocess_regions as preprocess_regions
from ._regions import region_layout as region_layout
from ._regions import region_patch as region_patch
from ._video import resize_reference as video_resize_reference
from ._video import video_rows as video_rows

__all__ = [
    "FIELDS",
    "KERNEL_PROCESSORS",
    "KIMI_LAYOUT",
    "KINDS",
    "RECORD_FIELDS",
    "SOURCE",
    "CupyLauncher",
    "ImageJob",
    "Launcher",
    "Layout",
    "OutputLayout",
    "Region",
    "compile_options",
    "kernel_source",
    "layout_of",
    "output_layout",
    "pack",
    "preprocess",
    "preprocess_packed",
    "preprocess_regions",
    "region_layout",
    "region_patch",
    "resize",
    "resize_packed",
    "to_device",
    "video_resize_reference",
    "video_rows",
]
