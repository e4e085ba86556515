"""mmwire.transport: typed feature envelopes and the backends that carry their payloads.

A backend is the path a payload takes to its owner: ``cpu`` (the producer's shared-memory
arena), ``cuda_ipc`` or ``fabric`` (a device pool), or zmq frames and the transfer engine
for a rank on another host. What an embedding engine calls is here; four namespaces hold
the rest: ``errors`` (every exception, rooted at ``errors.MmwireError``), ``wire`` (the
codec, payload references and views, for code that decodes frames itself), ``images``
(the image input contract) and ``videos`` (the video one).

General layout: ``errors`` (the exception tree), ``_index`` (GlobalIndex/LocalIndex and
their tables), ``_schema`` (the envelope Structs), ``_codec`` (frames <-> envelopes),
``_views`` (zero-copy array views), ``_pixels`` (the image input contract, with ``_arrow``
reading Pillow's memory in place), ``_items`` (what ``publish`` accepts), ``_prepare`` (an
item made what gets copied, with its envelope), ``_arena``, ``_handover`` and ``_control``
(the arena, its handover, the control messages and the table of joined consumers),
``_producer`` and ``_consumer`` (the two ends; the GPU backends are options of the one
producer, which is built from ``_channel``, ``_membership``, ``_control_loop``, ``_publish``
and ``_delivery``), ``_address`` (where a producer is), ``_group`` (one rank's consumers of
several producers), ``_aio`` (the asyncio ends), ``_cuda``, ``_device_pool`` and ``_gpu``
(the GPU backends' pools behind the same API), ``_select`` (what ``device_pool="auto"``
picks). Every public name is exported from one place only.
"""

from . import errors as errors
from . import images as images
from . import videos as videos
from . import wire as wire
from ._address import ProducerAddress as ProducerAddress
from ._aio import AsyncConsumer as AsyncConsumer
from ._aio import AsyncProducer as AsyncProducer
from ._arena import ArenaStatistics as ArenaStatistics
from ._consumer import Consumer as Consumer
from ._consumer import ConsumerStatistics as ConsumerStatistics
from ._consumer import ReceivedBatch as ReceivedBatch
from ._control import CurveKeys as CurveKeys
from ._gpu import DevicePoolStatistics as DevicePoolStatistics
from ._group import ConsumerGroup as ConsumerGroup
from ._index import GlobalIndex as GlobalIndex
from ._index import GlobalTable as GlobalTable
from ._index import IndexMap as IndexMap
from ._index import LocalIndex as LocalIndex
from ._index import LocalSlots as LocalSlots
from ._items import Item as Item
from ._mooncake import MooncakeTransfer as MooncakeTransfer
from ._producer import LostRequest as LostRequest
from ._producer import Producer as Producer
from ._producer import ProducerStatistics as ProducerStatistics
from ._schema import Background as Background
from ._schema import EncodedImage as EncodedImage
from ._schema import EncodedVideo as EncodedVideo
from ._schema import FeatureEnvelope as FeatureEnvelope
from ._schema import Grid as Grid
from ._schema import PanAndScan as PanAndScan
from ._schema import PreprocessSpec as PreprocessSpec
from ._schema import Processor as Processor
from ._schema import ResizePlan as ResizePlan
from ._schema import TensorSpec as TensorSpec
from ._select import BackendChoice as BackendChoice
from ._select import choose_backend as choose_backend

__all__ = [
    "ArenaStatistics",
    "AsyncConsumer",
    "AsyncProducer",
    "BackendChoice",
    "Background",
    "Consumer",
    "ConsumerGroup",
    "ConsumerStatistics",
    "CurveKeys",
    "DevicePoolStatistics",
    "EncodedImage",
    "EncodedVideo",
    "FeatureEnvelope",
    "GlobalIndex",
    "GlobalTable",
    "Grid",
    "IndexMap",
    "Item",
    "LocalIndex",
    "LocalSlots",
    "LostRequest",
    "MooncakeTransfer",
    "PanAndScan",
    "PreprocessSpec",
    "Processor",
    "Producer",
    "ProducerAddress",
    "ProducerStatistics",
    "ReceivedBatch",
    "ResizePlan",
    "TensorSpec",
    "choose_backend",
    "errors",
    "images",
    "videos",
    "wire",
]
