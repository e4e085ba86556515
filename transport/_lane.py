"""A rank on this host gets its batches on a lane of its own: a Unix ``SOCK_SEQPACKET`` pair.

Such a rank maps the arena, so its batches are headers of a few hundred bytes. Through zmq
each one passes two I/O threads on each side; on a 2-core host a zmq round trip cost
110 µs against 29 µs for a socket pair's. So the producer makes a pair per local member,
hands one end over with the arena, and writes that member's batches to the other: the
kernel keeps each packet whole and in order, wakes the rank directly, bounds the queue, and
ends the rank's reads with EOF when the producer goes. The channel (zmq) still carries
joins, releases and notices, and the rare batch that cannot take the lane.

Packets, producer -> rank:
    ``b"B"`` + a batch header (at most ``MAX_PACKET`` bytes in all);
    ``b"C"``: the next batch comes on the channel (one with frames of its own, such as an
    inline fallback's payloads, or a header over ``MAX_PACKET``), so order is kept.
Packets, rank -> producer:
    ``b"A"`` + u64: how many packets the rank has taken since it joined;
    ``b"R"`` + a control message: a release or a ``Done`` (``_control.py``), so the rank's
    releases take no zmq hop either, and are read in order before its end is served.

Back-pressure: the producer counts the packets it sent against the rank's latest count;
with ``backlog`` unacknowledged the lane is full, as a full zmq queue is, and the batch
waits. The rank acknowledges every ``ack_interval(backlog)`` packets, and the producer
reads its end when the lane looks full and whenever the control thread sees it readable,
so nothing piles up. Neither side trusts the other: a
count that goes back or past what was sent is ignored, a packet of the wrong shape is an
error of that one packet.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
from collections.abc import Callable

from .errors import FrameError

__all__ = ["MAX_PACKET", "Lane", "LaneReader", "ack_interval"]

MAX_PACKET = 1 << 16
"""The largest lane packet; a batch whose header is larger goes on the channel."""

BATCH = b"B"
ON_CHANNEL = b"C"
MESSAGE = b"R"
MAX_CONTROL = 512
"""The largest release or ``Done`` packet read (the channel drops control messages over
256 bytes; a longer packet is cut here and fails to decode)."""
_ACK = struct.Struct("<cQ")
_SEND_BUFFER = 4 << 20  # asked for; the kernel caps it at net.core.wmem_max


def ack_interval(backlog: int) -> int:
    """How many packets a rank takes between acknowledgements, for a lane of ``backlog``."""
    return max(1, backlog // 4)


class Lane:
    """The producer's end of one local member's lane (used under the producer's lock).

    ``send`` and ``announce`` return False when the lane is full (nothing was sent), and
    raise ``OSError`` when the rank's end is closed.
    """

    def __init__(
        self,
        backlog: int,
        on_message: Callable[[bytes], None],
        on_malformed: Callable[[str], None],
    ) -> None:
        self.sock, self.peer = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
        )
        self.sock.setblocking(False)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self.backlog = backlog
        self.sent = 0
        self.acked = 0
        self._on_message = on_message
        self._on_malformed = on_malformed

    def handed_over(self) -> None:
        """Close this process's copy of the rank's end, once it was sent."""
        self.peer.close()

    def send(self, header: bytes) -> bool:
        """Queue a batch header (``len(header) < MAX_PACKET``)."""
        return self._put([BATCH, header])

    def announce(self) -> bool:
        """Tell the rank that its next batch comes on the channel."""
        return self._put([ON_CHANNEL])

    def _put(self, parts: list[bytes]) -> bool:
        if self.sent - self.acked >= self.backlog:
            self.read()
            if self.sent - self.acked >= self.backlog:
                return False
        try:
            self.sock.sendmsg(parts, [], socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return False
        self.sent += 1  # not read here: the caller records the batch as sent first
        return True

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> None:
        """Serve what the rank sent that waits now: acknowledgements, and its releases and
        ``Done`` through ``on_message`` (bounded: a flood waits its turn)."""
        for _ in range(1024):
            try:
                packet = self.sock.recv(MAX_CONTROL + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # its end is closed: the next send says so
            if not packet:
                return
            if packet[:1] == MESSAGE:
                self._on_message(packet[1:])
                continue
            if len(packet) != _ACK.size or packet[:1] != b"A":
                self._on_malformed("a lane packet that is not an acknowledgement")
                continue
            _, taken = _ACK.unpack(packet)
            if self.acked <= taken <= self.sent:
                self.acked = taken
            else:
                self._on_malformed("an acknowledgement that goes back or past what was sent")

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def close(self) -> None:
        """Close both ends held here; the rank reads EOF."""
        self.sock.close()
        self.peer.close()


class LaneReader:
    """A rank's end of its lane."""

    def __init__(self, fd: int, backlog: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self._buf = bytearray(MAX_PACKET)
        self._every = ack_interval(backlog)
        self._taken = 0
        self._acked = 0
        self.ended = False
        """The producer closed the lane (it went away, or ended this member)."""
        self._watch = select.poll()
        self._watch.register(fd, select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def take(self) -> bytes | bool | None:
        """The next batch header; True: the next batch is on the channel; None: nothing
        waits (or the lane ended: ``ended``). ``FrameError`` for a packet of the wrong
        shape, which counts as one batch."""
        try:
            n = self.sock.recv_into(self._buf, MAX_PACKET, socket.MSG_TRUNC)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            n = 0
        if n == 0:
            self.ended = True
            return None
        self._taken += 1
        if self._taken - self._acked >= self._every:
            self._ack()
        kind = self._buf[:1]
        if n > MAX_PACKET:
            raise FrameError(f"a lane packet of {n} bytes, over {MAX_PACKET}")
        if kind == BATCH:
            return bytes(self._buf[1:n])
        if kind == ON_CHANNEL and n == 1:
            return True
        raise FrameError(f"a lane packet of {n} bytes of unknown kind {bytes(kind)!r}")

    def closed_by_producer(self) -> bool:
        """Whether the producer closed the lane and nothing is left to read (a peek: a
        waiting packet stays for ``take``)."""
        if self.ended:
            return True
        # a rank asks before every open: a poll answers "nothing waits, not hung up" with
        # no exception (an empty peek raises one, which costs about 10 µs); a packet, a
        # hang-up or an error is told apart by the peek
        if not self._watch.poll(0):
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def send(self, body: bytes) -> bool:
        """Send a release or ``Done``; False if the lane is full now (try again later).
        ``OSError``: the producer's end is closed."""
        try:
            self.sock.sendmsg([MESSAGE, body], [], socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return False
        return True

    def _ack(self) -> None:
        with contextlib.suppress(OSError):  # full: the next one carries the count
            self.sock.send(_ACK.pack(b"A", self._taken), socket.MSG_NOSIGNAL)
            self._acked = self._taken

    def close(self) -> None:
        self.ended = True
        if self.sock.fileno() >= 0:
            self._watch.unregister(self.sock.fileno())
        self.sock.close()
