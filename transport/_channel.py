"""The producer's end of the control channel: one zmq ROUTER socket.

Batches go out on it, one multipart message per member; joins, releases and ``Done``
come back on it. The socket never drops a message silently (``ROUTER_MANDATORY``: a full
or unknown peer raises), takes only small control messages in, and under CURVE admits
only the clients' keys. On ``tcp://`` a monitor reports peers that disconnect, so a dead
remote rank is noticed at once rather than at the heartbeat's timeout.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection, Iterator
from typing import Any, NamedTuple

import zmq

from ._control import NOTICE, CurveKeys
from .errors import ConfigurationError

__all__ = ["Channel", "Message", "check_security"]


class Message(NamedTuple):
    """A message from a peer: its frames (the first is the peer's identity), and the
    sender's CURVE public key when the channel has CURVE."""

    frames: list[bytes]
    key: bytes | None


def check_security(endpoint: str, curve: CurveKeys | None, allow_insecure_tcp: bool) -> None:
    """A ``tcp://`` channel needs CURVE, or the caller's word that the network is trusted
    (then it warns): anyone who reaches the port could otherwise join as any free rank."""
    if not endpoint.startswith("tcp://") or curve is not None:
        return
    if not allow_insecure_tcp:
        raise ConfigurationError(
            f"endpoint {endpoint!r} is tcp without CURVE: anyone who reaches the port "
            "could join as a rank; pass `curve=CurveKeys.generate()` (and the clients' "
            "keys), or `allow_insecure_tcp=True` on a network you trust"
        )
    warnings.warn(
        f"mmwire producer on {endpoint} without CURVE: anyone who reaches it can join",
        RuntimeWarning,
        stacklevel=3,
    )


class Channel:
    """A bound ROUTER socket, with CURVE when given keys. Not thread-safe: the producer
    uses it under its lock."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveKeys | None,
        curve_clients: Collection[bytes],
        max_backlog: int,
    ) -> None:
        self._ctx = zmq.Context()
        self._auth: Any = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        try:
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or unknown peer raises
            self.sock.setsockopt(zmq.SNDHWM, max_backlog)
            self.sock.setsockopt(zmq.RCVHWM, 100_000)
            self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 12)  # control messages are tiny
            # A peer that vanishes without closing (a remote host's crash) is dropped in 10 s.
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
            if curve is not None:
                self._start_curve(curve, curve_clients)
            try:
                self.sock.bind(address)
            except zmq.ZMQError as e:
                raise ConfigurationError(f"cannot bind the channel to {address!r}: {e}") from e
            if address.startswith("tcp://"):
                self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.fd = int(self.sock.getsockopt(zmq.FD))
        except BaseException:
            self.close()
            raise

    def _start_curve(self, keys: CurveKeys, clients: Collection[bytes]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        allowed = set(clients)

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return zmq.utils.z85.encode(key) in allowed or key in allowed

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_Keys())
        self.sock.curve_server = True
        self.sock.curve_secretkey = keys.secret
        self.sock.curve_publickey = keys.public

    def send(self, ident: bytes, frames: list[Any], *, track: bool = False) -> Any:
        """Queue one message for a peer without blocking; its ``MessageTracker`` when
        ``track`` (tracked frames go without a copy; the small rest are copied, which
        costs zmq less than wrapping each in a frame of its own).
        ``zmq.Again``: its queue is full; ``zmq.ZMQError``: no such peer."""
        return self.sock.send_multipart(
            [ident, *frames], flags=zmq.NOBLOCK, copy=not track, track=track
        )

    def notice(self, ident: bytes, text: str) -> None:
        """Tell a peer something (a refusal, an end), if it can take it now."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, NOTICE, text.encode()], flags=zmq.NOBLOCK)

    def connected(self, ident: bytes) -> bool:
        """Whether a peer's connection is still up (a ping it ignores)."""
        try:
            self.sock.send_multipart([ident, NOTICE, b"ping"], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: no such peer any more
        return True

    def messages(self) -> Iterator[Message]:
        """The messages waiting now. Control messages are a few bytes, which zmq hands over
        faster as bytes than as frames; under CURVE the frames are kept for the
        sender's key."""
        curve = self._auth is not None
        while int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=not curve)
            except zmq.Again:
                return
            key = None
            if curve and len(frames) > 1 and isinstance(frames[1], zmq.Frame):
                with contextlib.suppress(Exception):
                    key = str(frames[1].get("User-Id")).encode()
            yield Message([f if isinstance(f, bytes) else f.bytes for f in frames], key)

    def disconnected(self) -> bool:
        """Whether a peer disconnected since the last call (tcp only)."""
        if self.monitor is None or not self.monitor.poll(0):
            return False
        with contextlib.suppress(zmq.ZMQError):
            while self.monitor.recv_multipart(zmq.NOBLOCK):
                pass
        return True

    def close(self) -> None:
        """Close the socket (and its monitor), stop the authenticator, end the context."""
        if self.monitor is not None:  # closing the channel ends the monitoring
            self.monitor.close(0)
        self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
