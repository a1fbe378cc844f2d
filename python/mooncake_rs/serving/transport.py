"""KV movement between instance arenas: a copy thread per instance, so that sending
overlaps the engine's compute.

A job copies ``length`` bytes from one arena to another. Peers' arenas are found by
name: in-process through a shared registry (the local path: one memcpy), across
processes by mapping the peer's ``/dev/shm`` arena (the shm path: the initiator maps the
peer's region and copies once). numpy's copy releases the GIL, so the copy thread runs
while the engine thread computes.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .arena import map_shared

__all__ = ["Transport", "CopyJob"]


@dataclass(frozen=True)
class CopyJob:
    tag: int  # the request it belongs to
    dst: np.ndarray
    dst_off: int
    src: np.ndarray
    src_off: int
    length: int


class Transport:
    """Queues copies for one instance and runs them on its own thread."""

    def __init__(self, registry: dict[str, np.ndarray] | None = None) -> None:
        self._registry = registry  # in-process: name -> arena buffer
        self._mapped: dict[str, np.ndarray] = {}
        self._cv = threading.Condition()
        self._jobs: collections.deque[CopyJob] = collections.deque()
        self._pending: collections.Counter[int] = collections.Counter()
        self._bytes: collections.Counter[int] = collections.Counter()
        self.total_bytes = 0
        self.busy_s = 0.0
        self._stop = False
        self.on_idle: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="mooncake-transfer", daemon=True)
        self._thread.start()

    def peer(self, name: str) -> np.ndarray:
        """The arena buffer of a peer (the local one when in the registry)."""
        if self._registry is not None and name in self._registry:
            return self._registry[name]
        buf = self._mapped.get(name)
        if buf is None:
            buf = self._mapped[name] = map_shared(name)
        return buf

    def submit(self, job: CopyJob) -> None:
        with self._cv:
            self._jobs.append(job)
            self._pending[job.tag] += 1
            self._cv.notify()

    def copy_now(self, job: CopyJob) -> None:
        """A synchronous copy on the caller's thread (used for prefix fetches)."""
        np.copyto(job.dst[job.dst_off:job.dst_off + job.length], job.src[job.src_off:job.src_off + job.length])
        with self._cv:
            self._bytes[job.tag] += job.length
            self.total_bytes += job.length

    def pending(self, tag: int) -> int:
        with self._cv:
            return self._pending.get(tag, 0)

    def take_bytes(self, tag: int) -> int:
        with self._cv:
            return self._bytes.pop(tag, 0)

    def _run(self) -> None:
        import time

        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop and not self._jobs:
                    return
                job = self._jobs.popleft()
            t0 = time.perf_counter()
            np.copyto(job.dst[job.dst_off:job.dst_off + job.length], job.src[job.src_off:job.src_off + job.length])
            dt = time.perf_counter() - t0
            with self._cv:
                self.busy_s += dt
                self.total_bytes += job.length
                self._bytes[job.tag] += job.length
                self._pending[job.tag] -= 1
                if self._pending[job.tag] <= 0:
                    del self._pending[job.tag]
                idle = not self._jobs
            if idle and self.on_idle is not None:
                self.on_idle()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)
        self._mapped.clear()
