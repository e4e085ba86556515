"""Hand the arena's fd to each consumer process once, over a Unix socket with SCM_RIGHTS.

Layout
------
One stream connection per consumer process, kept open for its whole life::

    consumer -> producer   msgpack Hello{rank, pid}
    producer -> consumer   msgpack Offer{arena_id, size, pool}  + SCM_RIGHTS [memfd]
                                                   (+ the pool's fd for a posix_fd pool)
                     or    msgpack Refusal{reason}, then close

The socket lives in the producer's fresh ``0700`` directory, so other users cannot
even reach it; on top of that the producer checks ``SO_PEERCRED`` (same uid by default, or
an explicit allow-list) and refuses others.

States
------
*offered* (fd sent, connection open) -> *gone* (EOF or error on the connection).

Transitions
-----------
EOF on a consumer's connection means that process died or closed: the producer releases
every lease still waiting on its rank. EOF seen by a consumer means the producer is gone.

Invariants
----------
One arena fd (and at most one pool fd) per producer per consumer process, never one per
tensor (no ``ancdata`` exhaustion);
``pidfd_getfd`` is never used (it fails in unprivileged containers).

Lifetime
--------
The listening socket is removed by ``close()``; a crashed producer leaves a dead socket file
in its private directory at most, never memory.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import msgspec

from ._device_pool import PoolOffer
from ._errors import HandoverRefused, PeerGone

__all__ = ["Handover", "HandoverServer", "receive_arena"]


class Hello(msgspec.Struct, frozen=True, tag=True):
    rank: int
    pid: int


class Offer(msgspec.Struct, frozen=True, tag=True):
    arena_id: str
    size: int
    pool: PoolOffer | None = None
    """The producer's device pool, if it has one; a ``posix_fd`` pool's fd is the second fd."""


class Refusal(msgspec.Struct, frozen=True, tag=True):
    reason: str


_DEC = msgspec.msgpack.Decoder(Hello | Offer | Refusal)
_ENC = msgspec.msgpack.Encoder()


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process on the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class HandoverServer:
    """Accepts consumer processes, checks their credentials, and sends them the arena fd.

    A daemon thread accepts and watches the connections; ``on_gone(rank)`` is called once
    when a consumer's connection closes.
    """

    def __init__(
        self,
        path: str,
        arena_fd: int,
        arena_id: str,
        arena_size: int,
        on_gone: Callable[[int], None],
        *,
        allowed_uids: Collection[int] | None = None,
        pool: PoolOffer | None = None,
        pool_fd: int | None = None,
    ) -> None:
        self.path = path
        self._fds = [arena_fd] if pool_fd is None else [arena_fd, pool_fd]
        self._offer = _ENC.encode(Offer(arena_id=arena_id, size=arena_size, pool=pool))
        self._allowed = set(allowed_uids) if allowed_uids is not None else {os.getuid()}
        self._on_gone = on_gone
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._conns: dict[socket.socket, int] = {}
        self._lock = threading.Lock()
        self.refused = 0  # read by the producer's statistics()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mmwire-handover", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                watched: list[Any] = [self._listener, self._wake_r, *self._conns]
            try:
                ready, _, _ = select.select(watched, [], [])
            except (OSError, ValueError):
                return
            for r in ready:
                if r is self._wake_r:
                    return
                if r is self._listener:
                    self._accept()
                else:
                    self._check_gone(r)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        try:
            _, uid, _ = peer_credentials(conn)
            conn.settimeout(5.0)
            hello = _DEC.decode(_recv_msg(conn))
            if not isinstance(hello, Hello):
                raise HandoverRefused("expected a Hello")
            if uid not in self._allowed:
                self.refused += 1
                why = f"uid {uid} is not in the allowed uids {sorted(self._allowed)}"
                conn.sendall(_frame(_ENC.encode(Refusal(reason=why))))
                conn.close()
                return
            payload = _frame(self._offer)
            socket.send_fds(conn, [payload], self._fds)
            conn.settimeout(None)
            with self._lock:
                self._conns[conn] = hello.rank
        except (OSError, msgspec.MsgspecError, HandoverRefused):
            self.refused += 1
            conn.close()

    def _check_gone(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data:
            return  # consumers send nothing after Hello; ignore noise
        with self._lock:
            rank = self._conns.pop(conn, None)
        conn.close()
        if rank is not None:
            self._on_gone(rank)

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise PeerGone("the handover connection closed mid-message")
        buf += chunk
    return buf


def _recv_msg(conn: socket.socket, limit: int = 1 << 16) -> bytes:
    (n,) = struct.unpack("<I", _recv_exact(conn, 4))
    if n > limit:
        raise HandoverRefused(f"handover message of {n} bytes is over {limit}")
    return _recv_exact(conn, n)


class Handover(NamedTuple):
    """What a consumer process gets from the producer, once."""

    conn: socket.socket
    """Keep open for the life of the process: its EOF is each side's liveness signal."""
    fd: int
    arena_id: str
    size: int
    pool: PoolOffer | None
    pool_fd: int | None


def receive_arena(path: str, rank: int, timeout: float = 10.0) -> Handover:
    """Connect to a producer's handover socket and receive its arena (and device pool).

    Raises ``HandoverRefused`` or ``PeerGone`` (``__cause__`` = OSError).
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(timeout)
    try:
        conn.connect(path)
        conn.sendall(_frame(_ENC.encode(Hello(rank=rank, pid=os.getpid()))))
        # The fds ride on the first segment: receive them with the ancillary data, whole.
        first, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        if len(first) < 4:
            first += _recv_exact(conn, 4 - len(first))
        (n,) = struct.unpack("<I", first[:4])
        msg = first[4:]
        if len(msg) < n:
            msg += _recv_exact(conn, n - len(msg))
    except PermissionError as e:
        conn.close()
        raise HandoverRefused(f"cannot reach the handover socket {path!r}: {e}") from e
    except OSError as e:
        conn.close()
        raise PeerGone(f"handover with the producer at {path!r} failed: {e}") from e

    def fail(error: Exception) -> Exception:
        for fd in fds:
            os.close(fd)
        conn.close()
        return error

    try:
        reply = _DEC.decode(msg)
    except msgspec.MsgspecError as e:
        raise fail(
            PeerGone(f"the producer at {path!r} sent a malformed handover reply: {e}")
        ) from e
    if isinstance(reply, Refusal):
        raise fail(HandoverRefused(f"the producer refused this process: {reply.reason}"))
    want = 2 if reply_pool_fd(reply) else 1
    if not isinstance(reply, Offer) or len(fds) != want:
        raise fail(PeerGone(f"the producer sent {len(fds)} fds, expected {want}"))
    conn.settimeout(None)
    return Handover(
        conn, fds[0], reply.arena_id, reply.size, reply.pool, fds[1] if want == 2 else None
    )


def reply_pool_fd(reply: object) -> bool:
    """Whether an offer carries a second fd (a ``posix_fd`` device pool)."""
    return isinstance(reply, Offer) and reply.pool is not None and reply.pool.kind == "posix_fd"
