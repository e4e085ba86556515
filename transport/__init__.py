"""mmwire.transport: typed feature envelopes and the backends that carry their payloads.

General layout: ``_errors`` (the exception tree), ``_index`` (GlobalIndex/LocalIndex and
their tables), ``_schema`` (the envelope Structs), ``_codec`` (frames <-> envelopes),
``_views`` (zero-copy array views), ``_pixels`` (the image input contract, with ``_arrow``
reading Pillow's memory in place), ``_items`` (what ``publish`` accepts), ``_arena``,
``_handover`` and ``_control`` (the arena, its handover, the control messages and the table
of joined consumers), ``_producer`` and ``_consumer`` (the two ends; the GPU backends are
options of the one producer, which is built from ``_channel``, ``_membership``,
``_control_loop``, ``_publish`` and ``_delivery``), ``_address`` (where a producer is),
``_group`` (one rank's consumers of several producers), ``_aio`` (the asyncio ends),
``_cuda``, ``_device_pool`` and ``_gpu`` (the GPU backends' pools behind the same API),
``_select`` (what ``device_pool="auto"`` picks). Every public name is re-exported here
exactly once.
"""

from ._address import ProducerAddress as ProducerAddress
from ._aio import AsyncConsumer as AsyncConsumer
from ._aio import AsyncProducer as AsyncProducer
from ._arena import ArenaStatistics as ArenaStatistics
from ._codec import BatchDecoder as BatchDecoder
from ._codec import DecodedBatch as DecodedBatch
from ._codec import Limits as Limits
from ._codec import encode_batch as encode_batch
from ._consumer import Consumer as Consumer
from ._consumer import ConsumerStatistics as ConsumerStatistics
from ._consumer import ReceivedBatch as ReceivedBatch
from ._control import CurveKeys as CurveKeys
from ._errors import ArenaFull as ArenaFull
from ._errors import BackendUnavailable as BackendUnavailable
from ._errors import BusyResourceError as BusyResourceError
from ._errors import ByteLengthMismatch as ByteLengthMismatch
from ._errors import ClosedResourceError as ClosedResourceError
from ._errors import ConfigurationError as ConfigurationError
from ._errors import DimensionError as DimensionError
from ._errors import EnvelopeError as EnvelopeError
from ._errors import FrameError as FrameError
from ._errors import GridMismatch as GridMismatch
from ._errors import HandoverRefused as HandoverRefused
from ._errors import ImageDecodeError as ImageDecodeError
from ._errors import IntegrityError as IntegrityError
from ._errors import InvalidRequest as InvalidRequest
from ._errors import LimitExceeded as LimitExceeded
from ._errors import MalformedEnvelope as MalformedEnvelope
from ._errors import MaterializeError as MaterializeError
from ._errors import MmwireError as MmwireError
from ._errors import NotAConsumer as NotAConsumer
from ._errors import OffsetError as OffsetError
from ._errors import PeerGone as PeerGone
from ._errors import SchemaVersionError as SchemaVersionError
from ._errors import StaleReference as StaleReference
from ._errors import TransportError as TransportError
from ._errors import UnknownDtype as UnknownDtype
from ._errors import WaitTimeout as WaitTimeout
from ._gpu import DevicePoolStatistics as DevicePoolStatistics
from ._group import ConsumerGroup as ConsumerGroup
from ._index import GlobalIndex as GlobalIndex
from ._index import GlobalTable as GlobalTable
from ._index import IndexMap as IndexMap
from ._index import LocalIndex as LocalIndex
from ._index import LocalSlots as LocalSlots
from ._items import Item as Item
from ._mooncake import MooncakeTransfer as MooncakeTransfer
from ._pixels import MAX_IMAGE_PIXELS as MAX_IMAGE_PIXELS
from ._pixels import AlphaRule as AlphaRule
from ._pixels import encoded_image as encoded_image
from ._pixels import image_size as image_size
from ._pixels import keeps_alpha as keeps_alpha
from ._pixels import pixel_shape as pixel_shape
from ._pixels import pixels_into as pixels_into
from ._pixels import to_pixels as to_pixels
from ._producer import LostRequest as LostRequest
from ._producer import Producer as Producer
from ._producer import ProducerStatistics as ProducerStatistics
from ._schema import DTYPES as DTYPES
from ._schema import ENCODED_FORMATS as ENCODED_FORMATS
from ._schema import READABLE_VERSIONS as READABLE_VERSIONS
from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._schema import Background as Background
from ._schema import CpuRef as CpuRef
from ._schema import CudaIpcRef as CudaIpcRef
from ._schema import EncodedImage as EncodedImage
from ._schema import FabricRef as FabricRef
from ._schema import FeatureEnvelope as FeatureEnvelope
from ._schema import Grid as Grid
from ._schema import InlineRef as InlineRef
from ._schema import PayloadRef as PayloadRef
from ._schema import PreprocessSpec as PreprocessSpec
from ._schema import Processor as Processor
from ._schema import ResizePlan as ResizePlan
from ._schema import TensorSpec as TensorSpec
from ._select import BackendChoice as BackendChoice
from ._select import choose_backend as choose_backend
from ._views import numpy_view as numpy_view
from ._views import torch_view as torch_view

__all__ = [
    "DTYPES",
    "ENCODED_FORMATS",
    "MAX_IMAGE_PIXELS",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "AlphaRule",
    "ArenaFull",
    "ArenaStatistics",
    "AsyncConsumer",
    "AsyncProducer",
    "BackendChoice",
    "BackendUnavailable",
    "Background",
    "BatchDecoder",
    "BusyResourceError",
    "ByteLengthMismatch",
    "ClosedResourceError",
    "ConfigurationError",
    "Consumer",
    "ConsumerGroup",
    "ConsumerStatistics",
    "CpuRef",
    "CudaIpcRef",
    "CurveKeys",
    "DecodedBatch",
    "DevicePoolStatistics",
    "DimensionError",
    "EncodedImage",
    "EnvelopeError",
    "FabricRef",
    "FeatureEnvelope",
    "FrameError",
    "GlobalIndex",
    "GlobalTable",
    "Grid",
    "GridMismatch",
    "HandoverRefused",
    "ImageDecodeError",
    "IndexMap",
    "InlineRef",
    "IntegrityError",
    "InvalidRequest",
    "Item",
    "LimitExceeded",
    "Limits",
    "LocalIndex",
    "LocalSlots",
    "LostRequest",
    "MalformedEnvelope",
    "MaterializeError",
    "MmwireError",
    "MooncakeTransfer",
    "NotAConsumer",
    "OffsetError",
    "PayloadRef",
    "PeerGone",
    "PreprocessSpec",
    "Processor",
    "Producer",
    "ProducerAddress",
    "ProducerStatistics",
    "ReceivedBatch",
    "ResizePlan",
    "SchemaVersionError",
    "StaleReference",
    "TensorSpec",
    "TransportError",
    "UnknownDtype",
    "WaitTimeout",
    "choose_backend",
    "encode_batch",
    "encoded_image",
    "image_size",
    "keeps_alpha",
    "numpy_view",
    "pixel_shape",
    "pixels_into",
    "to_pixels",
    "torch_view",
]
