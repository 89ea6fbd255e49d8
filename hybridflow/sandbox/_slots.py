"""How many sandboxes one process runs at once: one limit shared by every caller, threads and event loops.

`SLOTS.hold()` (a context manager, for threads) and `SLOTS.hold_async()` (for asyncio) wait for a free slot in
first-come order; a waiter that is interrupted (an exception such as the reward pool's alarm, a cancelled
task) leaves the queue without losing or leaking a slot. A forked child starts with all slots free.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator

__all__ = ["SLOTS", "Slots", "default_max_concurrent_runs"]


def default_max_concurrent_runs() -> int:
    """The CPU cores this process may use, at least 4: sandboxes mostly wait on their programs' CPU time."""
    return max(4, len(os.sched_getaffinity(0)))


class Slots:
    """A fair counting semaphore usable from threads and from any number of event loops."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self.size, self._free = size, size
        self._waiters: deque[threading.Event | tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.size - self._free

    def resize(self, size: int) -> None:
        """Allow `size` runs at once from now on (runs in progress keep their slots)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"max_concurrent_runs must be an int >= 1, got {size!r}")
        with self._lock:
            self._free += size - self.size
            self.size = size
            while self._free > 0 and self._waiters:
                self._free -= 1
                self._hand_over(self._waiters.popleft())

    def _take(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    def release(self) -> None:
        with self._lock:
            if self._waiters and self._free >= 0:
                self._hand_over(self._waiters.popleft())
            else:
                self._free += 1

    def _hand_over(self, waiter) -> None:
        """Give a slot to `waiter` (under the lock)."""
        if isinstance(waiter, threading.Event):
            waiter.set()
            return
        loop, future = waiter
        try:
            loop.call_soon_threadsafe(self._deliver, future)
        except RuntimeError:  # that loop is closed: its waiter is gone, the slot goes to the next one
            self._free += 1
            while self._free > 0 and self._waiters:
                self._free -= 1
                self._hand_over(self._waiters.popleft())

    def _deliver(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self.release()  # cancelled after the hand-over was scheduled: pass the slot on
        else:
            future.set_result(None)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Wait for a slot (blocking this thread), hold it for the block."""
        with self._lock:
            event = None if self._take() else threading.Event()
            if event is not None:
                self._waiters.append(event)
        if event is not None:
            try:
                event.wait()
            except BaseException:
                with self._lock:
                    queued = event in self._waiters
                    if queued:
                        self._waiters.remove(event)
                if not queued:
                    self.release()  # the slot arrived as we were interrupted
                raise
        try:
            yield
        finally:
            self.release()

    @contextlib.asynccontextmanager
    async def hold_async(self) -> AsyncIterator[None]:
        """Wait for a slot without blocking the event loop, hold it for the block."""
        loop = asyncio.get_running_loop()
        with self._lock:
            waiter = None if self._take() else (loop, loop.create_future())
            if waiter is not None:
                self._waiters.append(waiter)
        if waiter is not None:
            try:
                await waiter[1]
            except BaseException:
                with self._lock:
                    queued = waiter in self._waiters
                    if queued:
                        self._waiters.remove(waiter)
                if not queued and waiter[1].done() and not waiter[1].cancelled():
                    self.release()  # delivered, then our task was cancelled: give it back
                raise  # (a delivery still pending sees the cancelled future and passes the slot on)
        try:
            yield
        finally:
            self.release()


SLOTS = Slots(default_max_concurrent_runs())


def _reset_after_fork() -> None:
    global SLOTS
    SLOTS = Slots(SLOTS.size)


os.register_at_fork(after_in_child=_reset_after_fork)
