"""A pool's arena mapped into a client on the same host, for copies without the transfer
engine in between.

The pool's store lives in a shared-memory segment (``Opened.shm_name``). A client on the
same host (equal boot id: ``Opened.host_id``) maps it and moves a layer's blocks with one
:func:`~mooncake_rs._core.copy_segments` call on its own thread (the GIL released, each
block's CRC-32 folded into the copy). That is the same memcpy the transfer engine's shm
path does, without its per-request bookkeeping and its hand-off to copy threads, which on
a CPU host compete with the forward pass for the same cores anyway. Slots still come
from ``Reserve`` / ``Lookup`` (leases and reservations keep them ours while we copy);
clients on other hosts (or with the ``shm`` transport off) use the transfer engine.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os

__all__ = ["SharedArena", "host_id"]

log = logging.getLogger("mooncake_rs.kvpool")


@functools.cache
def host_id() -> str:
    """This host's identity for "same memory?": the kernel's boot id (one per boot of one
    machine; equal across network namespaces of that machine). "" when unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# madvise(2) advice (Linux 5.14; not in Python 3.11's mmap module): page tables made now
# as by a write to every page, without writing.
MADV_POPULATE_WRITE = 23


def _map_populated(fd: int, size: int) -> mmap.mmap:
    """``fd`` mapped shared and writable, its page tables made now, once: without that
    the first copy into each 4 KiB page of a slot takes a fault, which made a fresh
    mapping's copies 10-20x slower than a warm one's (BENCHMARKS.md, issue 23).
    MADV_POPULATE_WRITE makes them as a write would, so marked dirty; MAP_POPULATE (the
    fallback before Linux 5.14) makes them as a read would, and then the first store into
    each page still pays for setting its dirty bit (a page walk; in a VM ~0.3 us a page),
    which halved the first save into fresh slots (5.7 vs 9-10 GB/s, BENCHMARKS.md)."""
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        m.madvise(MADV_POPULATE_WRITE)
        return m
    except (OSError, ValueError):  # an older kernel (EINVAL): populate as a read does
        m.close()
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class SharedArena:
    """The mapping of one pool's arena; :attr:`view` is its writable bytes."""

    def __init__(self, m: mmap.mmap) -> None:
        self._map = m
        self.view: memoryview | None = memoryview(m)

    @classmethod
    def open(cls, shm_name: str, pool_host: str, need_bytes: int) -> SharedArena | None:
        """The arena when the pool runs on this host and its segment can be mapped (at
        least ``need_bytes`` long); None otherwise (the caller copies through the engine)."""
        if not shm_name or not pool_host or pool_host != host_id():
            return None
        path = os.path.join("/dev/shm", shm_name.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            log.info("pool arena %s not mappable here (%s); copying through the transfer engine", path, e)
            return None
        try:
            size = os.fstat(fd).st_size
            if size < need_bytes:
                log.warning("pool arena %s holds %d bytes, the pool reported %d; not mapping it", path, size,
                            need_bytes)
                return None
            return cls(_map_populated(fd, size))
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
            self._map.close()
