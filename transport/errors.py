"""The one exception tree of mmwire, split by fault.

Every error the library raises on purpose derives from :class:`MmwireError`, so a serving
loop can catch it per request and keep serving. Messages name the offending field or item
in backticks, what was expected, what was found, and the limit or setting involved.

Tree::

    MmwireError
    ├── EnvelopeError (also ValueError)      bytes or fields that do not form a valid envelope
    │   ├── MalformedEnvelope                 not decodable / wrong type / missing field
    │   ├── SchemaVersionError                written by an incompatible schema version
    │   ├── UnknownDtype                      dtype outside the whitelist
    │   ├── DimensionError                    non-positive or oversized dimension
    │   │   └── LimitExceeded                 over a configured pixel/byte ceiling
    │   ├── ByteLengthMismatch                nbytes != prod(shape) * itemsize
    │   ├── OffsetError                       negative offset / outside the arena or lease
    │   ├── GridMismatch                      rows of a processed tensor disagree with its grid
    │   └── FrameError                        missing, extra or wrong-size inline frames
    ├── InvalidRequest (also ValueError)      a publish the producer refuses before allocating
    ├── ConfigurationError (also ValueError)  an argument that cannot work (rank, endpoint)
    ├── NotAConsumer (also LookupError)       this rank is not in the item's consumer set
    ├── StaleReference                        the referenced lease was released and reused
    ├── ArenaFull                             no room in the arena within the wait timeout
    ├── TransportError                        a peer or the OS failed us (``__cause__`` = OSError)
    │   ├── PeerGone                          the producer/consumer process went away
    │   ├── HandoverRefused                   credentials check failed on the handover socket
    │   ├── BackendUnavailable                a backend's library or driver is missing
    │   └── IntegrityError                    pulled bytes are not those their digest names
    ├── WaitTimeout (also TimeoutError)       what a call waited for did not come in time
    ├── ClosedResourceError                   *your* code closed the object before using it
    ├── BusyResourceError                     concurrent use of a single-user object
    └── MaterializeError (also ValueError)    a request's pixels cannot be turned into features
        ├── ImageDecodeError                  encoded image bytes that do not decode (``__cause__``)
        └── VideoDecodeError                  a video that does not decode, or not as declared
"""

from __future__ import annotations

__all__ = [
    "ArenaFull",
    "BackendUnavailable",
    "BusyResourceError",
    "ByteLengthMismatch",
    "ClosedResourceError",
    "ConfigurationError",
    "DimensionError",
    "EnvelopeError",
    "FrameError",
    "GridMismatch",
    "HandoverRefused",
    "ImageDecodeError",
    "IntegrityError",
    "InvalidRequest",
    "LimitExceeded",
    "MalformedEnvelope",
    "MaterializeError",
    "MmwireError",
    "NotAConsumer",
    "OffsetError",
    "PeerGone",
    "SchemaVersionError",
    "StaleReference",
    "TransportError",
    "UnknownDtype",
    "VideoDecodeError",
    "WaitTimeout",
]


class MmwireError(Exception):
    """Root of every error mmwire raises on purpose."""


class EnvelopeError(MmwireError, ValueError):
    """Bytes or fields that do not form a valid feature envelope."""


class MalformedEnvelope(EnvelopeError):
    """Not decodable as an envelope batch: truncated, wrong type, missing or unknown field."""


class SchemaVersionError(EnvelopeError):
    """The envelope was written by a schema version this library does not read."""


class UnknownDtype(EnvelopeError):
    """A tensor dtype outside the whitelist (see ``mmwire.transport.DTYPES``)."""


class DimensionError(EnvelopeError):
    """A non-positive dimension, or a shape/grid of the wrong rank."""


class LimitExceeded(DimensionError):
    """A pixel count or byte length over the configured ceiling (see ``Limits``)."""


class ByteLengthMismatch(EnvelopeError):
    """A declared byte length that is not ``prod(shape) * itemsize``."""


class OffsetError(EnvelopeError):
    """A negative offset, or a range outside the arena, lease or pool it names."""


class GridMismatch(EnvelopeError):
    """A processed tensor whose rows disagree with its grid, or a produced grid that differs."""


class FrameError(EnvelopeError):
    """Inline payload frames missing, surplus, or of the wrong size."""


class InvalidRequest(MmwireError, ValueError):
    """A publish refused before anything was allocated: no items, a bad request id, an item
    of an unsupported type or dtype, or a ``preprocess`` callable that raised (``__cause__``)."""


class ConfigurationError(MmwireError, ValueError):
    """A constructor argument that cannot work: a rank out of range, ``tcp://`` without CURVE."""


class NotAConsumer(MmwireError, LookupError):
    """This rank is not in the item's consumer set: it reads the metadata, never the payload."""


class StaleReference(MmwireError):
    """The reference's lease was released and its slot reused (generation mismatch)."""


class ArenaFull(MmwireError):
    """The arena had no room for a request within the configured wait."""


class TransportError(MmwireError):
    """A peer or the operating system failed; ``__cause__`` holds the underlying error."""


class PeerGone(TransportError):
    """The process on the other end went away (crashed, killed or closed)."""


class HandoverRefused(TransportError):
    """The handover socket refused a peer whose credentials are not allowed."""


class BackendUnavailable(TransportError):
    """A backend cannot be used here: its library or driver is missing or refuses."""


class IntegrityError(TransportError):
    """Bytes read over an unauthenticated data plane that are not those their envelope's
    digest names: someone wrote into the transfer window or the receive pool."""


class WaitTimeout(MmwireError, TimeoutError):
    """What a call waited for (a batch, a rank's join) did not come within its timeout; the
    message names the rank or producer and what it waited for."""


class ClosedResourceError(MmwireError):
    """The object was closed by its owner before this call."""


class BusyResourceError(MmwireError):
    """The object is in use by another thread and does not support concurrent use."""


class MaterializeError(MmwireError, ValueError):
    """One request's pixels cannot be turned into model inputs; other requests are unaffected."""


class ImageDecodeError(MaterializeError):
    """Encoded image bytes that Pillow cannot decode; ``__cause__`` holds Pillow's error."""


class VideoDecodeError(MaterializeError):
    """Video bytes that FFmpeg cannot read, or whose frames differ from their header (size,
    count); ``__cause__`` holds FFmpeg's error where there is one."""
