"""A kernel's time as the device spends it, and the host's time per call, measured apart.

Timing a launch with an event before and after it on an idle stream, synchronizing after each repeat, measures the
host's launcher as well as the kernel: the start event fires at once on the idle device, and the kernel starts only
when the launcher (tiling, allocation, Triton's dispatch) has returned. For a kernel of a few microseconds that is
most of the figure. Here the two are taken apart:

- **host time per call**: ``reps`` calls back to back while the stream is held busy, timed on the host clock, so no
  call waits for the device: the launcher alone.
- **device time**: the stream is first *held* (busy work enqueued ahead, long enough for the host to enqueue every
  repeat behind it), then each repeat is ``flush, start mark, call, end mark``: the flush evicts the last repeat's
  data from L2 (a write of a buffer larger than L2), and the marks fire back to back with the kernel, so ``end -
  start`` is the kernel's time on the device alone. The median over the repeats is reported.

The hold is checked, not trusted: marks around it give its length on the device, and if that is not longer than
the host took to enqueue every repeat behind it, the device may have waited for the host; then the repeats run again
behind a longer hold (and the figure is flagged if it still was not long enough).

The device is an object with five operations (:class:`Stream`); :class:`CudaStream` is CUDA's, through public torch
APIs only (events, and fills of one buffer for both the flush and the hold). ``tests/test_benchmarks_kernels.py``
proves the method on a simulated stream whose stand-in kernel has a known device time and a known host delay.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Stream(Protocol):
    """What the timer needs of a device's stream. Marks and holds are enqueued (they return at once)."""

    def mark(self) -> object:
        """Enqueues a timestamp; returns its handle."""

    def elapsed(self, start: object, end: object) -> float:
        """Seconds on the device between two marks (after :meth:`synchronize`)."""

    def flush(self) -> None:
        """Enqueues a write that evicts the cache between repeats."""

    def hold(self, seconds: float) -> None:
        """Enqueues busy work of at least ``seconds`` on the device."""

    def synchronize(self) -> None:
        """Waits until the stream has done everything enqueued."""


@dataclass(frozen=True)
class Timing:
    """One kernel's figures: seconds on the device (median over repeats), seconds of host per call (launcher
    alone), the repeats, and whether the device still waited for the host after the longest hold (the device time
    then includes host time)."""

    device_s: float
    host_s: float
    reps: int
    starved: bool = False
    holds: int = 1


def host_time(fn: Callable[[], object], stream: Stream, reps: int, clock: Callable[[], float] = time.perf_counter,
              hold_s: float = 0.05) -> float:  # fmt: skip
    """Seconds of host time per call of ``fn``: ``reps`` calls back to back behind a held stream (the launches queue
    and never wait for the device), timed on ``clock``."""
    stream.synchronize()
    stream.hold(hold_s)
    t0 = clock()
    for _ in range(reps):
        fn()
    seconds = (clock() - t0) / reps
    stream.synchronize()
    return seconds


def device_time(fn: Callable[[], object], stream: Stream, reps: int, host_s: float,
                clock: Callable[[], float] = time.perf_counter, flush_host_s: float | None = None,
                attempts: int = 3) -> tuple[float, bool, int]:  # fmt: skip
    """(median device seconds of ``fn``, whether the device still waited for the host on the last attempt, attempts
    made).

    ``host_s``: one call's host time (:func:`host_time`) and ``flush_host_s`` one flush's (measured here when None)
    size the hold. The hold is checked: marks before and after it give its device time ``D``; the host's clock gives
    the time ``L`` from the first mark's enqueue to the last repeat's. The first mark cannot fire before it is
    enqueued, so the hold ends at least ``D`` after the host's ``t0``; if ``D > L`` it ended after the host had
    enqueued everything, and the device never waited. Otherwise the hold is made 4x longer and the repeats run
    again, up to ``attempts`` times."""
    if flush_host_s is None:
        flush_host_s = host_time(stream.flush, stream, 10, clock)
    per_rep = host_s + flush_host_s
    margin = 2.0
    for attempt in range(1, attempts + 1):
        stream.synchronize()
        before = stream.mark()
        t0 = clock()
        stream.hold(margin * reps * per_rep + 1e-3)
        after = stream.mark()
        marks = []
        for _ in range(reps):
            stream.flush()
            start = stream.mark()
            fn()
            marks.append((start, stream.mark()))
        enqueued = clock() - t0
        stream.synchronize()
        times = [stream.elapsed(a, b) for a, b in marks]
        if stream.elapsed(before, after) > enqueued:
            return statistics.median(times), False, attempt
        margin *= 4
    return statistics.median(times), True, attempts


def measure(fn: Callable[[], object], stream: Stream, reps: int = 20, warmup: int = 3,
            clock: Callable[[], float] = time.perf_counter, attempts: int = 3) -> Timing:  # fmt: skip
    """Both figures of ``fn`` (see the module docstring); ``attempts``: holds tried (:func:`device_time`)."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    host = host_time(fn, stream, reps, clock)
    device, starved, holds = device_time(fn, stream, reps, host, clock, attempts=attempts)
    return Timing(device, host, reps, starved, holds)


def launch_inclusive(fn: Callable[[], object], stream: Stream, reps: int = 20) -> float:
    """The old figure, kept to show the difference: a mark before and after one call on an idle stream, synchronized
    after each repeat (launcher + kernel)."""
    times = []
    for _ in range(reps):
        stream.synchronize()
        a = stream.mark()
        fn()
        b = stream.mark()
        stream.synchronize()
        times.append(stream.elapsed(a, b))
    return statistics.median(times)


class CudaStream:
    """:class:`Stream` on the current CUDA stream: events for marks, fills of one buffer (``flush_bytes``, larger
    than any L2: 256 MB) for the flush, and repeated fills of it for a hold (their device time calibrated once)."""

    def __init__(self, flush_bytes: int = 256 << 20):
        import torch

        self.torch = torch
        self.buffer = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
        # one fill's device time, from 8 back to back (a large op: the launch is hidden behind the previous one)
        self.buffer.fill_(0)
        torch.cuda.synchronize()
        a, b = self.mark(), None
        for _ in range(8):
            self.buffer.fill_(1)
        b = self.mark()
        torch.cuda.synchronize()
        self.fill_s = self.elapsed(a, b) / 8

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def flush(self) -> None:
        self.buffer.fill_(0)

    def hold(self, seconds: float) -> None:
        for _ in range(max(1, math.ceil(seconds / self.fill_s))):
            self.buffer.fill_(0)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()


class SimulatedStream:
    """A device for testing the method on a CPU: a host clock that advances only when told (:meth:`spend`), and a
    stream that runs enqueued work in order, each item starting when both it has been enqueued and the stream is
    free. ``kernel(device_s, host_s)`` is a stand-in launch with a known cost on each side; a flush costs
    ``flush_s`` on the device and ``flush_host_s`` on the host; a mark costs ``mark_host_s`` on the host."""

    def __init__(self, flush_s: float = 50e-6, flush_host_s: float = 4e-6, mark_host_s: float = 1e-6):
        self.now = 0.0  # the host clock
        self.free = 0.0  # when the stream has done its work
        self.flush_s, self.flush_host_s, self.mark_host_s = flush_s, flush_host_s, mark_host_s

    def clock(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds

    def enqueue(self, seconds: float) -> float:
        """Work of ``seconds`` on the device; returns when it starts."""
        start = max(self.now, self.free)
        self.free = start + seconds
        return start

    def kernel(self, device_s: float, host_s: float) -> Callable[[], None]:
        def launch() -> None:
            self.spend(host_s)  # the launcher runs on the host, then the kernel is enqueued
            self.enqueue(device_s)

        return launch

    def mark(self) -> float:
        self.spend(self.mark_host_s)
        return self.enqueue(0.0)

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def flush(self) -> None:
        self.spend(self.flush_host_s)
        self.enqueue(self.flush_s)

    def hold(self, seconds: float) -> None:
        self.enqueue(seconds)

    def synchronize(self) -> None:
        self.now = max(self.now, self.free)
