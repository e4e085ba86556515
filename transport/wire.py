"""The wire, for code that reads or writes envelopes itself: the schema's version and
whitelists, the batch codec, the payload references and zero-copy views of payload bytes.

A consumer gets all of this done by :class:`mmwire.transport.Consumer`; these are for a
process that decodes frames of its own (a router, a recorder, a test).
"""

from ._codec import BatchDecoder as BatchDecoder
from ._codec import DecodedBatch as DecodedBatch
from ._codec import Limits as Limits
from ._codec import encode_batch as encode_batch
from ._schema import DTYPES as DTYPES
from ._schema import READABLE_VERSIONS as READABLE_VERSIONS
from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._schema import CpuRef as CpuRef
from ._schema import CudaIpcRef as CudaIpcRef
from ._schema import FabricRef as FabricRef
from ._schema import InlineRef as InlineRef
from ._schema import PayloadRef as PayloadRef
from ._views import numpy_view as numpy_view
from ._views import torch_view as torch_view

__all__ = [
    "DTYPES",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "BatchDecoder",
    "CpuRef",
    "CudaIpcRef",
    "DecodedBatch",
    "FabricRef",
    "InlineRef",
    "Limits",
    "PayloadRef",
    "encode_batch",
    "numpy_view",
    "torch_view",
]
