"""Memory given by address (what Mooncake's API takes: ``ptr, size`` ints) as numpy views,
so the Rust store and transfer engine read and write it in place.

An address is only as valid as its caller says: the facade checks that it lies inside a
buffer the caller registered (``register_buffer``) when it has that information, but a
raw address cannot be checked further. Views made here do not own the memory.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core import Region
from ..errors import InvalidArgument

__all__ = ["view_at", "gather", "scatter", "address_of", "RegisteredBuffers", "RegisteredBuffer"]


def view_at(ptr: int, size: int) -> np.ndarray:
    """A writable uint8 view of ``size`` bytes at ``ptr`` (no copy)."""
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size < 0:
        raise InvalidArgument(f"a buffer is a positive address and a size >= 0, got ptr={ptr!r} size={size!r}")
    if size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(memoryview((ctypes.c_char * size).from_address(ptr)).cast("B"), dtype=np.uint8)


def gather(ptrs: list[int], sizes: list[int], out: np.ndarray) -> None:
    """Copies the pieces one after another into ``out``."""
    pos = 0
    base = out.ctypes.data
    for p, n in zip(ptrs, sizes):
        ctypes.memmove(base + pos, p, n)
        pos += n


def scatter(src: np.ndarray, ptrs: list[int], sizes: list[int]) -> None:
    """Copies ``src`` piece by piece out to the addresses."""
    pos = 0
    base = src.ctypes.data
    for p, n in zip(ptrs, sizes):
        ctypes.memmove(p, base + pos, n)
        pos += n


@dataclass(frozen=True)
class RegisteredBuffer:
    ptr: int
    size: int
    #: what the transfer engine gave it (None while the client has no engine)
    region: Region | None = None


class RegisteredBuffers:
    """The address ranges a caller registered; a remote batch finds the one holding each
    of its pieces among their ``regions()`` (in Rust: transfer/objects.rs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ptr: dict[int, RegisteredBuffer] = {}
        self._sorted: list[RegisteredBuffer] = []
        self._regions: list[Region] = []

    def _changed(self) -> None:
        """Called with the lock held."""
        self._sorted = sorted(self._by_ptr.values(), key=lambda b: b.ptr)
        self._regions = [b.region for b in self._sorted if b.region is not None]

    def add(self, buf: RegisteredBuffer) -> None:
        with self._lock:
            self._by_ptr[buf.ptr] = buf
            self._changed()

    def remove(self, ptr: int) -> RegisteredBuffer | None:
        with self._lock:
            buf = self._by_ptr.pop(ptr, None)
            self._changed()
            return buf

    def regions(self) -> list[Region]:
        """The transfer engine's regions of the buffers, by address (what a remote batch
        looks the caller's pieces up in, in Rust)."""
        return self._regions

    def all(self) -> list[RegisteredBuffer]:
        return list(self._sorted)


def address_of(value: Any) -> tuple[np.ndarray, int]:
    """A buffer as a flat uint8 array (a copy only when it is not contiguous) and its
    address (0 when empty); keep the array while the address is used."""
    arr = np.frombuffer(memoryview(value).cast("B"), dtype=np.uint8) if not isinstance(value, np.ndarray) \
        else value.reshape(-1).view(np.uint8)
    return arr, (arr.ctypes.data if arr.size else 0)
