"""An item of a checked request turned into what gets copied (:class:`PreparedItem`: host
bytes, a CUDA tensor, or an image decoded straight into its slot), with its spec, its
content digest and its envelope, before anything is allocated."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

from ._digest import digest_of, envelope_alpha
from ._index import GlobalIndex
from ._items import Item
from ._pixels import (
    MAX_IMAGE_PIXELS,
    ImageHeader,
    image_size,
    pixel_shape,
    pixels_into,
    to_pixels,
)
from ._schema import (
    DTYPES,
    ENCODED_FORMATS,
    SCHEMA_VERSION,
    CpuRef,
    CudaIpcRef,
    EncodedImage,
    EncodedVideo,
    FabricRef,
    FeatureEnvelope,
    InlineRef,
    Kind,
    PreprocessSpec,
    TensorSpec,
    VideoSpec,
)
from ._torch import is_cuda_tensor, is_tensor
from ._video import MAX_FRAME_PIXELS, probe_video, video_format
from ._views import dtype_name
from .errors import InvalidRequest, MalformedEnvelope, MmwireError

__all__ = ["PreparedItem", "envelope", "located", "payload_digest", "prepare"]

Payload = CpuRef | InlineRef | CudaIpcRef | FabricRef
_T = TypeVar("_T")


@dataclass(slots=True)
class PreparedItem:
    """An item checked and turned into what gets copied: a host array, or a CUDA tensor."""

    item: Item
    array: np.ndarray[Any, Any] | None
    """Host bytes to copy into the arena (``None`` for a tensor kept on its GPU, or an image
    ``write_into`` decodes there)."""
    dtype: str
    shape: tuple[int, ...]
    spec: PreprocessSpec | None
    encoding: EncodedImage | None = None
    """An encoded item's header: ``array`` is its compressed bytes."""
    image: Any = None
    """A raw image (PIL image, encoded bytes, array) whose ``shape`` pixels ``write_into``
    decodes into the arena: one copy, not three."""
    digest: str | None = None
    """The payload's content digest, when the data as given is the bytes that ship (a PIL
    image's is taken from its pixels once they are in the arena)."""
    cuda: torch.Tensor | None = None
    """A contiguous CUDA tensor that travels through the host: ``write_into`` copies it
    into the arena (one D2H copy, by DMA where the arena is registered)."""
    video: VideoSpec | None = None
    """A video's spec: ``array`` is its container's bytes (with the spec's header) or its
    sampled frames."""

    @property
    def kind(self) -> Kind:
        """The envelope's kind: ``encoded`` for bytes that ship as they are."""
        if self.encoding is not None or (self.video is not None and self.video.header):
            return "encoded"
        return "raw" if self.video is not None else self.item.kind

    @property
    def alpha(self) -> str:
        """How the item's spec treats alpha (part of an image's digest; ``""`` for tensors)."""
        return envelope_alpha(self.kind, self.spec.alpha if self.spec is not None else None)

    @property
    def nbytes(self) -> int:
        """Host bytes to copy (0 for a tensor kept on its GPU)."""
        if self.image is not None:
            return math.prod(self.shape)
        if self.cuda is not None:
            return self.cuda.numel() * self.cuda.element_size()
        return 0 if self.array is None else int(self.array.nbytes)

    def write_into(self, dst: np.ndarray[Any, Any]) -> None:
        """Put the item's host bytes into ``dst`` (uint8, ``nbytes`` long)."""
        if self.image is not None:
            alpha = self.spec.alpha if self.spec is not None else "keep"
            # its size was checked against the producer's ceiling when it was prepared
            ceiling = self.shape[0] * self.shape[1]
            pixels_into(self.image, dst.reshape(self.shape), alpha=alpha, max_pixels=ceiling)
        elif self.cuda is not None:
            import torch

            torch.from_numpy(dst).view(self.cuda.dtype).view(self.cuda.shape).copy_(self.cuda)
        elif self.array is not None:
            dst[:] = self.array.reshape(-1).view(np.uint8)

    def host_bytes(self) -> np.ndarray[Any, Any]:
        """The item's host bytes in a buffer of their own."""
        buf = np.empty(self.nbytes, np.uint8)
        self.write_into(buf)
        return buf


def prepare(
    request_id: str,
    index: int,
    item: Item,
    on_device: tuple[tuple[int, ...], str] | None,
    *,
    digests: str = "images",
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> PreparedItem:
    """Turn one item's data into host bytes (unless ``on_device`` gives its pool placement's
    shape and dtype), resolve its spec and take its content digest where the data as given
    is what ships (``digests``: ``"images"``, ``"all"`` or ``"none"``)."""
    where = f"item {index} of request {request_id!r}"
    key = item.caller_key
    if key is not None and (type(key) is not str or not 0 < len(key) <= 128):
        raise InvalidRequest(f"{where}: `caller_key` must be a str of 1 to 128 characters")
    if on_device is not None:
        shape, dtype = on_device
        return PreparedItem(item, None, dtype, shape, _spec(item, shape, where))
    p = _prepare(where, item, max_pixels)
    if digests == "all" or (digests == "images" and item.kind in ("raw", "encoded")):
        p = dataclasses.replace(p, digest=_source_digest(p))
    return p


def _source_digest(p: PreparedItem) -> str | None:
    """The digest of the data as given, when those are the bytes that ship: encoded bytes,
    a tensor's elements, uint8 pixels already ``(H, W, C)`` and contiguous. ``None`` for the
    rest (PIL images, strided or composited pixels: digested from the arena once written)."""
    if p.image is None:  # processed, embedding, or an encoded item's bytes
        return None if p.array is None else payload_digest(p, p.array)
    source = p.image
    if is_tensor(source) and not is_cuda_tensor(source):
        source = source.detach().numpy()
    if (
        isinstance(source, np.ndarray)
        and source.dtype == np.uint8
        and source.flags.c_contiguous
        and source.size == math.prod(p.shape)
        and (source.ndim == 2 or source.shape[-1] == p.shape[-1])
    ):
        return payload_digest(p, source)
    return None


def payload_digest(p: PreparedItem, shipped: Any) -> str:
    """The digest of an item's bytes as they ship (the arena's copy, or the same bytes)."""
    return digest_of(p.kind, p.dtype, p.shape, p.alpha, shipped)


def _prepare(where: str, item: Item, max_pixels: int) -> PreparedItem:
    data = item.data
    if item.modality == "video" and item.kind in ("raw", "encoded"):
        return _prepare_video(where, item, max_pixels)
    if is_cuda_tensor(data):
        if item.kind not in ("raw", "encoded"):
            return _on_gpu(where, item, data)
        data = data.cpu()
    if item.kind == "encoded" and (
        not isinstance(data, (bytes, bytearray, memoryview)) or item.decode
    ):
        raise InvalidRequest(f"{where}: an encoded item takes the encoded bytes, undecoded")
    if item.kind in ("raw", "encoded"):
        # the spec first, from the size alone: its processor says how to treat alpha; then
        # the container (encoded bytes ship as they are) or the pixels' shape (decoded
        # later, straight into the arena). Bytes' header is read once for all three.
        as_bytes = isinstance(data, (bytes, bytearray, memoryview))
        header = located(where, ImageHeader, data) if as_bytes else None
        width, height = located(where, image_size, data) if header is None else header.size
        spec = _spec(item, (height, width), where)
        alpha = spec.alpha if spec is not None else "keep"
        if header is not None and not item.decode:
            enc = located(where, lambda h: h.encoded(alpha=alpha, max_pixels=max_pixels), header)
            if enc is not None:
                buf = data if isinstance(data, (bytes, bytearray)) else bytes(data)
                raw = np.frombuffer(buf, np.uint8)
                return PreparedItem(item, raw, "uint8", raw.shape, spec, enc)
            if item.kind == "encoded":
                raise InvalidRequest(
                    f"{where}: an encoded item must be one of {sorted(ENCODED_FORMATS)}"
                )
        if header is not None:
            shape = located(where, lambda h: h.shape(alpha=alpha, max_pixels=max_pixels), header)
        else:
            shape = located(
                where, lambda d: pixel_shape(d, alpha=alpha, max_pixels=max_pixels), data
            )
        return PreparedItem(item, None, "uint8", shape, spec, image=data)
    arr, dtype = located(where, lambda d: _as_array(d, where), data)
    dims: tuple[int, ...] = arr.shape  # numpy's shape is a tuple of ints
    return PreparedItem(item, arr, dtype, dims, _spec(item, dims, where))


def _prepare_video(where: str, item: Item, max_pixels: int) -> PreparedItem:
    """A video's container read to its header, or its frames cut to the sampled ones; its
    spec computed and checked against them."""
    data = item.data
    if item.decode:
        raise InvalidRequest(f"{where}: a video travels as its container or its frames")
    if isinstance(data, (bytes, bytearray, memoryview)):
        if video_format(data) is None:
            raise InvalidRequest(f"{where}: a video's bytes must be MP4, MOV, WebM or Matroska")
        ceiling = min(max_pixels, MAX_FRAME_PIXELS)
        header = located(where, lambda d: probe_video(d, max_frame_pixels=ceiling), data)
        spec = _video_spec(item, header, where)
        if spec.header != header:
            raise InvalidRequest(f"{where}: its `preprocess` is another video's spec")
        raw = np.frombuffer(data if isinstance(data, (bytes, bytearray)) else bytes(data), np.uint8)
        return PreparedItem(item, raw, "uint8", raw.shape, None, video=spec)
    if item.kind == "encoded" or is_cuda_tensor(data):
        raise InvalidRequest(f"{where}: an encoded video takes the container's bytes")
    frames = located(where, _frames, data)
    n, height, width = frames.shape[:3]
    if height * width > max_pixels:
        raise InvalidRequest(f"{where}: frames of {width}x{height}, over {max_pixels} pixels")
    spec = _video_spec(item, (n, height, width), where)
    plan = spec.plan
    if spec.header is not None or (plan.width, plan.height) != (width, height):
        raise InvalidRequest(f"{where}: its `preprocess` is another video's spec")
    if plan.indices[-1] >= n:
        raise InvalidRequest(f"{where}: its plan samples frame {plan.indices[-1]} of {n}")
    if plan.indices != tuple(range(n)):
        frames = frames[list(plan.indices)]
    return PreparedItem(item, frames, "uint8", frames.shape, None, video=spec)


def _frames(data: Any) -> np.ndarray[Any, Any]:
    """Video frames as uint8 ``(T, H, W, 3)``, C-contiguous."""
    arr: np.ndarray[Any, Any]
    try:
        if isinstance(data, (list, tuple)):
            arr = np.stack([np.asarray(f) for f in data]) if data else np.empty(0, np.uint8)
        elif is_tensor(data):
            arr = data.detach().numpy()
        else:
            arr = np.asarray(data)
    except (TypeError, ValueError) as e:  # frames of different sizes, a dtype numpy lacks
        raise InvalidRequest(f"video frames must be uint8 (T, H, W, 3) alike: {e}") from e
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[3] != 3 or 0 in arr.shape:
        raise InvalidRequest(
            f"video frames must be uint8 (T, H, W, 3), got {arr.dtype} {list(arr.shape)}"
        )
    return np.ascontiguousarray(arr)


def _video_spec(item: Item, video: EncodedVideo | tuple[int, int, int], where: str) -> VideoSpec:
    spec = item.preprocess
    if isinstance(spec, VideoSpec):
        return spec
    if not callable(spec):
        raise InvalidRequest(
            f"{where}: a video needs its `preprocess`: a VideoSpec, or a callable such as "
            "mmwire.materialize.video.video_spec_for(...)"
        )
    try:
        got = spec(video)  # type: ignore[call-arg, arg-type]
    except Exception as e:
        raise InvalidRequest(f"{where}: its `preprocess` callable raised {e!r}") from e
    if not isinstance(got, VideoSpec):
        raise InvalidRequest(
            f"{where}: its `preprocess` callable returned a {type(got).__name__}, not a VideoSpec"
        )
    return got


def located(where: str, f: Callable[[Any], _T], data: Any) -> _T:
    """``f(data)``, its ``MmwireError`` prefixed with the item it is about."""
    try:
        return f(data)
    except MmwireError as e:
        raise type(e)(f"{where}: {e}") from e.__cause__


def _spec(item: Item, shape: tuple[int, ...], where: str) -> PreprocessSpec | None:
    spec = item.preprocess
    if spec is None or isinstance(spec, PreprocessSpec):
        return spec
    if isinstance(spec, VideoSpec):
        raise InvalidRequest(f"{where}: a VideoSpec is for `modality='video'` items")
    if not callable(spec):
        raise InvalidRequest(f"{where}: `preprocess` must be a spec or a callable")
    if len(shape) < 2:
        raise InvalidRequest(f"{where}: a `preprocess` callable needs (H, W, ...) data")
    try:
        got = spec(shape[1], shape[0])  # type: ignore[call-arg, arg-type]
    except Exception as e:
        raise InvalidRequest(f"{where}: its `preprocess` callable raised {e!r}") from e
    if not isinstance(got, PreprocessSpec):
        raise InvalidRequest(
            f"{where}: its `preprocess` callable returned a {type(got).__name__}, "
            "not a PreprocessSpec"
        )
    return got


def _on_gpu(where: str, item: Item, data: torch.Tensor) -> PreparedItem:
    """A processed or embedding CUDA tensor bound for the host: checked now, copied into
    the arena (not into a staging buffer first) when the lease is written."""
    t = data.detach().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    dims = tuple(int(d) for d in t.shape)
    _check_elements(where, name, dims)
    return PreparedItem(item, None, name, dims, _spec(item, dims, where), cuda=t)


def _as_array(data: Any, where: str) -> tuple[np.ndarray[Any, Any], str]:
    """A C-contiguous array of a processed/embedding item's data and its dtype name."""
    if is_tensor(data):
        import torch

        # each tensor call costs several µs at these sizes: detach only what needs it, and
        # let numpy make the copy a strided tensor needs
        t = data.detach() if data.requires_grad else data
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy(), "bfloat16"
        arr = t.numpy()
    elif isinstance(data, np.ndarray):
        arr = data
    elif isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, "getbands"):
        return to_pixels(data), "uint8"
    else:
        raise InvalidRequest(
            f"{where}: cannot publish {type(data).__name__}: give an array, tensor, PIL image "
            "or bytes"
        )
    if not arr.dtype.isnative:  # the wire's dtypes are little-endian, as the hosts are
        arr = arr.astype(arr.dtype.newbyteorder("="))
    arr = np.ascontiguousarray(arr)
    name = dtype_name(arr.dtype)
    _check_elements(where, name, arr.shape)
    return arr, name


def _check_elements(where: str, dtype: str, shape: tuple[int, ...]) -> None:
    """``InvalidRequest`` for a dtype that may not travel or a payload with no elements."""
    if dtype not in DTYPES:
        raise InvalidRequest(f"{where}: dtype `{dtype}` is not in the whitelist {sorted(DTYPES)}")
    if len(shape) == 0 or math.prod(shape) == 0:
        raise InvalidRequest(f"{where}: an empty array of shape {list(shape)}")


def envelope(
    request_id: str, index: int, prepared: PreparedItem, nbytes: int, payload: Payload
) -> FeatureEnvelope:
    """The envelope of one prepared item (raises an ``EnvelopeError`` for a bad one)."""
    item, spec = prepared.item, prepared.spec
    grid = item.grid
    if grid is None and spec is not None:
        grid = spec.plan.grid
    elif grid is None and prepared.video is not None:
        grid = prepared.video.plan.grid
    where = f"item {index} of request {request_id!r}"
    if grid is None:
        raise MalformedEnvelope(f"{where} needs a `grid`")
    try:
        return FeatureEnvelope(
            version=SCHEMA_VERSION,
            request_id=request_id,
            index=GlobalIndex(index),
            modality=item.modality,
            kind=prepared.kind,
            grid=grid,
            tensor=TensorSpec(dtype=prepared.dtype, shape=prepared.shape, nbytes=nbytes),
            payload=payload,
            consumers=tuple(item.consumers),
            preprocess=spec,
            digest=prepared.digest,
            encoding=prepared.encoding,
            caller_key=item.caller_key,
            video=prepared.video,
        )
    except MmwireError:
        raise
    except Exception as e:  # a field of the wrong type reaching a cross-field check
        raise MalformedEnvelope(f"{where}: {e}") from e
