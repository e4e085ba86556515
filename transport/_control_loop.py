"""The producer's control thread: joins, releases, finished sends and timeouts are served
whether or not the application calls ``Producer.poll``.

``service`` does one round of that work, under the producer's lock; the publishing thread
calls it too, so a publish sees every release that has arrived. Every use of the zmq
socket is under that lock, and nothing blocks while holding it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time

import zmq

from ._channel import Channel
from ._delivery import Delivery
from ._membership import Roster

__all__ = ["ControlLoop"]

# Seconds between sweeps for members that never joined, leases held too long, and remote
# members whose connection went without a word; and between pings of remote members.
_SWEEP_S = 0.25
_PING_S = 1.0

# How long the thread lets messages gather after the first one wakes it: one round then
# serves them all. While batches are going out, every round takes the GIL and a core from
# the publishing thread and the ranks: at 1 ms, 64 KiB to four ranks took 12 % longer on a
# 2-core host than at 20 ms. No request waits on this: a publish that finds no room serves
# the channel itself, and a lane reads its rank's acknowledgements when it fills. Once
# publishing stops, releases are served within 1 ms again.
_GATHER_S = 0.001
_GATHER_BUSY_S = 0.02


class ControlLoop:
    """One thread serving a producer's channel, and the round of work it does."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        activity: threading.Condition,
        channel: Channel,
        roster: Roster,
        delivery: Delivery,
        join_timeout: float,
        lease_timeout: float | None,
    ) -> None:
        self.lock = lock
        self.activity = activity
        self.channel = channel
        self.roster = roster
        self.delivery = delivery
        self.join_timeout = join_timeout
        self.lease_timeout = lease_timeout
        self._last_sweep = 0.0
        self._last_ping = 0.0
        self._next_end: float | None = None  # when a closed member's grace runs out
        self._stopped = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # the descriptors the thread sleeps on, read here: the sockets are not the thread's
        self._watched = [self._wake_r, channel.fd]
        if channel.monitor is not None:
            self._watched.append(int(channel.monitor.getsockopt(zmq.FD)))
        self._thread = threading.Thread(target=self._run, name="mmwire-control", daemon=True)
        self._thread.start()

    def service(self) -> None:
        """Process everything pending: messages, finished sends, timeouts (under the lock)."""
        disconnected = self.channel.disconnected()
        busy = self.roster.serve_channel()  # first what the peers sent before going
        for lane in self.roster.lanes():
            lane.read()
        if disconnected:
            self.roster.check_remote()
        busy |= self.delivery.finish_sends()
        self._next_end = self.roster.finish_ends()
        now = time.monotonic()
        if now - self._last_sweep > _SWEEP_S:
            self._last_sweep = now
            self.roster.members.expire(self.join_timeout)
            if now - self._last_ping > _PING_S:
                self._last_ping = now
                self.roster.check_remote()
            if self.lease_timeout is not None:
                self.roster.expire_leases(self.lease_timeout)
        if busy:
            self.activity.notify_all()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the channel or a lane to have something to serve."""
        with self.lock:
            fds = [self.channel.fd, *(lane.fileno() for lane in self.roster.lanes())]
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        with contextlib.suppress(OSError, ValueError):
            poller.poll(timeout * 1000)

    def _run(self) -> None:
        """Serve the channel and the lanes when something arrives (a message, a
        disconnection, a wake), and at each sweep's time; nothing otherwise."""
        poller = select.poll()
        for fd in self._watched:
            poller.register(fd, select.POLLIN)
        lanes: set[int] = set()  # the lanes' descriptors registered
        hung: set[int] = set()  # lanes whose rank end closed: read once more, not watched
        while not self._stopped:
            if self.roster.lanes_changed:
                with self.lock:
                    self.roster.lanes_changed = False
                    now_open = {lane.fileno() for lane in self.roster.lanes()}
                hung &= now_open
                for fd in lanes - now_open:
                    poller.unregister(fd)
                for fd in now_open - lanes - hung:
                    poller.register(fd, select.POLLIN)
                lanes = now_open - hung
            due = self._last_sweep + _SWEEP_S
            if self._next_end is not None:
                due = min(due, self._next_end)
            wait = max(0.0, due - time.monotonic())
            try:
                ready = poller.poll(wait * 1000)
                for fd, events in ready:
                    if fd in lanes and events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        poller.unregister(fd)  # it reads ready for good: its end is gone
                        lanes.discard(fd)
                        hung.add(fd)
                if any(fd == self._wake_r for fd, _ in ready) and not self._stopped:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if ready and not self._stopped:
                    busy = time.monotonic() - self.delivery.last_start < _GATHER_BUSY_S
                    select.select([self._wake_r], [], [], _GATHER_BUSY_S if busy else _GATHER_S)
            except (OSError, ValueError):
                return
            with self.lock:
                if self._stopped:
                    return
                try:
                    self.service()
                except Exception as e:  # a bug must not stop releases for everyone
                    self.roster.note("service", f"the control thread caught {e!r}")

    def wake(self) -> None:
        """Have the thread serve a round now (its next deadline may have moved closer)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def stop(self) -> None:
        """End the thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
