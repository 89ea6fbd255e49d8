"""The process-wide limit on sandboxes running at once (`set_max_concurrent_runs`), shared by threads and event
loops, fair, and never leaking a slot when a waiter is interrupted (attack 3: 256 concurrent tool calls)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from hybridflow.sandbox import SandboxLimits, _slots, max_concurrent_runs, run_python, run_python_async
from hybridflow.sandbox import set_max_concurrent_runs
from tests.helpers import most_at_once

# Prints when it slept (CLOCK_MONOTONIC is one clock for every process of the machine).
SLEEP = "import time\nstart = time.monotonic()\ntime.sleep(0.3)\nprint(start, time.monotonic())"


@pytest.fixture
def two_slots():
    previous = max_concurrent_runs()
    set_max_concurrent_runs(2)
    yield
    set_max_concurrent_runs(previous)
    assert _slots.SLOTS.in_use == 0


def test_threads_and_event_loop_share_the_limit(two_slots):
    """Three threads and three async tasks start a sandbox each: never more than two run at once."""
    intervals, lock = [], threading.Lock()
    limits = SandboxLimits(isolation="none", wall_time_s=5)

    def record(result) -> None:
        assert result.ok, result
        with lock:
            intervals.append(tuple(map(float, result.stdout.split())))

    # The slots in use, sampled every millisecond.
    seen, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(_slots.SLOTS.in_use)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=lambda: record(run_python(SLEEP, limits=limits))) for _ in range(3)]
    for thread in threads:
        thread.start()

    async def tasks():
        async def one():
            record(await run_python_async(SLEEP, limits=limits))
        await asyncio.gather(*[one() for _ in range(3)])

    asyncio.run(tasks())
    for thread in threads:
        thread.join()
    stop.set()
    sampler.join()
    assert len(intervals) == 6
    assert max(seen) == 2, "two sandboxes ran at once, never more"
    # Each program's sleep lies inside its slot: at no instant did more than two programs sleep, whatever the load.
    assert most_at_once(intervals) <= 2, intervals


def test_interrupted_waiters_do_not_leak_slots():
    slots = _slots.Slots(1)

    async def main():
        async with slots.hold_async():
            waiter = asyncio.create_task(slots.hold_async().__aenter__())
            await asyncio.sleep(0.01)
            waiter.cancel()  # cancelled while queued
            with pytest.raises(asyncio.CancelledError):
                await waiter
        assert slots.in_use == 0
        async with slots.hold_async():  # the slot is still there
            assert slots.in_use == 1

    asyncio.run(main())

    class Alarm(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, on_alarm)
    held = threading.Event()
    release = threading.Event()

    def holder():
        with slots.hold():
            held.set()
            release.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    signal.setitimer(signal.ITIMER_REAL, 0.05)  # the reward pool's timeout, while this thread waits
    try:
        with pytest.raises(Alarm):
            with slots.hold():
                pytest.fail("got a slot that was taken")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
        thread.join()
    assert slots.in_use == 0
    with slots.hold():
        assert slots.in_use == 1


def test_first_come_first_served_and_resize():
    slots, order = _slots.Slots(1), []

    async def one(name: str):
        async with slots.hold_async():
            order.append(name)
            await asyncio.sleep(0.01)

    async def main():
        await asyncio.gather(*[one(str(i)) for i in range(5)])

    asyncio.run(main())
    assert order == ["0", "1", "2", "3", "4"]
    slots.resize(3)
    assert slots.size == 3 and slots.in_use == 0
    with pytest.raises(ValueError, match="max_concurrent_runs"):
        set_max_concurrent_runs(0)
