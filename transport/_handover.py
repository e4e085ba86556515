"""Hand the arena's fd to each consumer process once, over a Unix socket with SCM_RIGHTS.

Layout
------
One stream connection per consumer process, kept open for its whole life::

    consumer -> producer   msgpack Hello{rank, pid, replace}
    producer -> consumer   msgpack Offer{arena_id, size, member, pool, lane}
                           + SCM_RIGHTS [memfd (+ the pool's fd for a posix_fd pool)
                                         (+ the process's end of its lane)]
                     or    msgpack Refusal{reason}, then close

Every message is a little-endian u32 length and that many bytes of msgpack. The socket is
abstract (``@name``: no file, reachable from the producer's network namespace), so the
producer checks ``SO_PEERCRED`` (same uid by default, or an explicit allow-list) and refuses
others before reading a byte. The fd sent is read-only (``_arena.py``).

States
------
*pending* (accepted, Hello not complete; at most ``hello_timeout`` s) -> *offered* (fd and
member token sent, connection open) -> *gone* (EOF or error). A pending connection that
closes, sends garbage, stays silent or names an invalid rank is dropped and counted; it
never delays another connection, since one thread serves all of them without blocking.

Transitions
-----------
EOF on an offered connection means that process died or closed: ``on_gone(member)`` runs
once, and the producer releases what that member held. :meth:`HandoverServer.drop` closes
a member's connection from the producer's side (eviction, replacement); the consumer sees
EOF and reports ``PeerGone``.

Invariants
----------
One arena fd (and at most one pool fd and one lane) per producer per consumer process, never one per
tensor (no ``ancdata`` exhaustion); ``pidfd_getfd`` is never used (it fails in unprivileged
containers); nothing a peer sends can stop the thread (every error is per connection).

Lifetime
--------
An abstract socket goes with its process: a closed or crashed producer leaves no file and
no memory behind (a socket given as a file path is removed by ``close()``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection
from typing import Annotated, NamedTuple

import msgspec

from ._device_pool import PoolOffer
from .errors import ConfigurationError, HandoverRefused, PeerGone

__all__ = ["MAX_RANKS", "Handover", "HandoverServer", "check_rank", "receive_arena"]

_log = logging.getLogger("mmwire.transport")

MAX_RANKS = 1 << 16
"""Ranks are ``0 <= rank < MAX_RANKS``."""

_MAX_MESSAGE = 1 << 16


def socket_address(path: str) -> str:
    """The address to bind or connect: ``@name`` is the abstract socket ``name`` (no file,
    gone with its process, reachable from the same network namespace), else a file path."""
    return "\0" + path[1:] if path.startswith("@") else path


def check_rank(rank: object) -> int:
    """``rank`` if it is an int in ``[0, MAX_RANKS)``, else ``ConfigurationError``."""
    if type(rank) is not int or not 0 <= rank < MAX_RANKS:
        raise ConfigurationError(f"`rank` must be an int in [0, {MAX_RANKS}), got {rank!r}")
    return rank


class Hello(msgspec.Struct, frozen=True, tag=True):
    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    pid: int
    replace: bool = False


class Offer(msgspec.Struct, frozen=True, tag=True):
    arena_id: str
    size: int
    member: bytes = b""
    """The token this process joins the channel with; it ties leases to this process."""
    pool: PoolOffer | None = None
    """The producer's device pool, if it has one; a ``posix_fd`` pool's fd is the second fd."""
    lane: int = 0
    """The backlog of this process's lane for its batches (``_lane.py``), whose end is the
    last fd; 0: no lane, batches come on the channel."""


class Refusal(msgspec.Struct, frozen=True, tag=True):
    reason: str


_DEC = msgspec.msgpack.Decoder(Hello | Offer | Refusal)
_ENC = msgspec.msgpack.Encoder()

Admit = Callable[[Hello, int], "tuple[Offer, list[int]] | Refusal"]
"""The producer's decision on a Hello from process ``pid``: an offer (a new member) and the
fds of that member's own to send after the shared ones, or why not."""


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process on the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class _Pending:
    __slots__ = ("buf", "deadline", "pid")

    def __init__(self, pid: int, deadline: float) -> None:
        self.pid = pid
        self.deadline = deadline
        self.buf = b""


class HandoverServer:
    """Accepts consumer processes, checks their credentials, and sends them the arena fd.

    One daemon thread serves every connection without blocking on any of them. ``admit``
    decides on each complete Hello; ``on_gone(member)`` is called once when an offered
    connection closes.
    """

    def __init__(
        self,
        path: str,
        fds: list[int],
        admit: Admit,
        on_gone: Callable[[bytes], None],
        *,
        allowed_uids: Collection[int] | None = None,
        hello_timeout: float = 5.0,
    ) -> None:
        self.path = path
        self._fds = fds
        self._admit = admit
        self._allowed = set(allowed_uids) if allowed_uids is not None else {os.getuid()}
        self._on_gone = on_gone
        self._hello_timeout = hello_timeout
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(socket_address(self.path))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._pending: dict[socket.socket, _Pending] = {}
        self._offered: dict[socket.socket, bytes] = {}
        self._drops: list[bytes] = []
        self._lock = threading.Lock()
        self.refused = 0  # read by the producer's statistics()
        self._logged: set[str] = set()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mmwire-handover", daemon=True)
        self._thread.start()

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            watched: list[socket.socket | int] = [
                self._listener,
                self._wake_r,
                *self._pending,
                *self._offered,
            ]
            try:
                ready, _, _ = select.select(watched, [], [], 0.25)
            except (OSError, ValueError):
                if self._closed:
                    return
                continue
            for r in ready:
                if self._closed:
                    return
                try:
                    if r is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    elif r is self._listener:
                        self._accept()
                    elif r in self._pending:
                        self._read_hello(r)
                    elif r in self._offered:
                        self._check_gone(r)
                except Exception as e:  # no peer can stop this thread
                    self._note("error", f"handover: dropped a connection after {e!r}")
                    if isinstance(r, socket.socket) and r is not self._listener:
                        self._discard(r)
            self._expire()
            self._apply_drops()

    def _accept(self) -> None:
        for _ in range(64):  # bounded: a connect flood cannot starve the other connections
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._note("fds", "handover: out of file descriptors, a connection waits")
                return
            conn.setblocking(False)
            pid, uid, _ = peer_credentials(conn)
            if uid not in self._allowed:
                why = f"uid {uid} is not in the allowed uids {sorted(self._allowed)}"
                self._refuse(conn, why, "uid")
                continue
            self._pending[conn] = _Pending(pid, time.monotonic() + self._hello_timeout)

    def _read_hello(self, conn: socket.socket) -> None:
        state = self._pending[conn]
        try:
            chunk = conn.recv(_MAX_MESSAGE + 4 - len(state.buf))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close_pending(conn, "closed before its hello")
            return
        state.buf += chunk
        if len(state.buf) < 4:
            return
        (n,) = struct.unpack_from("<I", state.buf)
        if n > _MAX_MESSAGE:
            self._refuse(conn, f"a handover message of {n} bytes is over {_MAX_MESSAGE}", "size")
            return
        if len(state.buf) < 4 + n:
            return
        del self._pending[conn]
        try:
            hello = _DEC.decode(state.buf[4 : 4 + n])
        except msgspec.MsgspecError as e:
            self._refuse(conn, f"a malformed hello: {e}", "malformed")
            return
        if not isinstance(hello, Hello):
            self._refuse(conn, "expected a Hello")
            return
        answer = self._admit(hello, state.pid)
        if isinstance(answer, Refusal):
            self._refuse(conn, answer.reason, f"admit {hello.rank}")
            return
        reply, own_fds = answer
        conn.settimeout(1.0)  # a small message into an empty socket buffer
        try:
            socket.send_fds(conn, [_frame(_ENC.encode(reply))], [*self._fds, *own_fds])
        except OSError:
            conn.close()
            self._on_gone(reply.member)
            return
        conn.setblocking(False)
        with self._lock:
            self._offered[conn] = reply.member

    def _check_gone(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # consumers send nothing after Hello; noise is read and ignored
        with self._lock:
            member = self._offered.pop(conn, None)
        conn.close()
        if member is not None:
            self._on_gone(member)

    def _discard(self, conn: socket.socket) -> None:
        """Forget a connection whatever its state (after an unexpected error on it)."""
        with self._lock:
            member = self._offered.pop(conn, None)
        self._close_pending(conn)
        if member is not None:
            self._on_gone(member)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, state in list(self._pending.items()):
            if state.deadline < now:
                self._close_pending(conn, f"sent no hello within {self._hello_timeout} s")

    def _apply_drops(self) -> None:
        with self._lock:
            drops, self._drops = set(self._drops), []
            gone = [c for c, s in self._offered.items() if s in drops]
            for c in gone:
                del self._offered[c]
        for c in gone:
            c.close()

    def _refuse(self, conn: socket.socket, why: str, kind: str = "") -> None:
        self._pending.pop(conn, None)
        self.refused += 1
        self._note(kind or why, f"handover refused pid {_pid_of(conn)}: {why}")
        with contextlib.suppress(OSError):
            conn.send(_frame(_ENC.encode(Refusal(reason=why))))
        conn.close()

    def _close_pending(self, conn: socket.socket, why: str = "") -> None:
        if self._pending.pop(conn, None) is not None:
            self.refused += 1
            if why:
                self._note(why, f"handover: a connection {why}; dropped")
        conn.close()

    def _note(self, kind: str, message: str) -> None:
        """Log the first event of each kind; the rest are counted in ``refused``."""
        if kind not in self._logged:
            self._logged.add(kind)
            _log.warning("mmwire %s (further ones are not logged)", message)

    # -- the producer's side ----------------------------------------------------------

    def drop(self, member: bytes) -> None:
        """Close ``member``'s connection (without ``on_gone``): its process sees EOF."""
        with self._lock:
            self._drops.append(member)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for c in [*self._pending, *self._offered]:
                c.close()
            self._pending.clear()
            self._offered.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if not self.path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _pid_of(conn: socket.socket) -> int | str:
    try:
        return peer_credentials(conn)[0]
    except OSError:
        return "?"


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


class Handover(NamedTuple):
    """What a consumer process gets from the producer, once."""

    conn: socket.socket
    """Keep open for the life of the process: its EOF is each side's liveness signal."""
    fd: int
    arena_id: str
    size: int
    member: bytes
    pool: PoolOffer | None
    pool_fd: int | None
    lane_fd: int | None
    """This process's end of its lane for batches (``_lane.py``), if the producer gave one."""
    lane_backlog: int


def receive_arena(
    path: str, rank: int, timeout: float = 10.0, *, replace: bool = False
) -> Handover:
    """Connect to a producer's handover socket and receive its arena (and device pool).

    ``replace`` takes the rank over from a live process that holds it. Raises
    ``ConfigurationError`` for a rank out of range, ``HandoverRefused`` or ``PeerGone``
    (``__cause__`` = OSError).
    """
    check_rank(rank)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(timeout)
    fds: list[int] = []
    try:
        conn.connect(socket_address(path))
        try:
            conn.sendall(_frame(_ENC.encode(Hello(rank=rank, pid=os.getpid(), replace=replace))))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before our hello was read: its Refusal is waiting to be received
        # The fds ride on the first segment: receive them with the ancillary data, whole.
        first, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE + 4, 3)
        if not first:
            raise PeerGone(f"the producer at {path!r} closed the handover without a reply")
        if len(first) < 4:
            first += _recv_exact(conn, 4 - len(first))
        (n,) = struct.unpack("<I", first[:4])
        if n > _MAX_MESSAGE:
            raise PeerGone(f"the producer at {path!r} sent a {n}-byte handover reply")
        msg = first[4:]
        if len(msg) < n:
            msg += _recv_exact(conn, n - len(msg))
    except PermissionError as e:
        _close_all(conn, fds)
        raise HandoverRefused(f"cannot reach the handover socket {path!r}: {e}") from e
    except OSError as e:
        _close_all(conn, fds)
        raise PeerGone(f"handover with the producer at {path!r} failed: {e}") from e
    except PeerGone:
        _close_all(conn, fds)
        raise

    def fail(error: Exception) -> Exception:
        _close_all(conn, fds)
        return error

    try:
        reply = _DEC.decode(msg)
    except msgspec.MsgspecError as e:
        raise fail(
            PeerGone(f"the producer at {path!r} sent a malformed handover reply: {e}")
        ) from e
    if isinstance(reply, Refusal):
        raise fail(HandoverRefused(f"the producer refused this process: {reply.reason}"))
    pool_fd = reply_pool_fd(reply)
    lane = isinstance(reply, Offer) and reply.lane > 0
    want = 1 + pool_fd + lane
    if not isinstance(reply, Offer) or len(fds) != want:
        raise fail(PeerGone(f"the producer sent {len(fds)} fds, expected {want}"))
    conn.settimeout(None)
    return Handover(
        conn,
        fds[0],
        reply.arena_id,
        reply.size,
        reply.member,
        reply.pool,
        fds[1] if pool_fd else None,
        fds[-1] if lane else None,
        reply.lane,
    )


def _close_all(conn: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    conn.close()


def reply_pool_fd(reply: object) -> bool:
    """Whether an offer carries a second fd (a ``posix_fd`` device pool)."""
    return isinstance(reply, Offer) and reply.pool is not None and reply.pool.kind == "posix_fd"
