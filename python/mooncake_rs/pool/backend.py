"""What ``DistributedStore`` needs from where the pool lives: the embedded segment
(local.py) or the deployment (remote.py). Batch calls only; one result per key."""

from __future__ import annotations

from typing import Protocol

from .buffers import RegisteredBuffer, RegisteredBuffers
from .metrics import PoolMetrics
from .status import KeyStatus

__all__ = ["Backend"]


class Backend(Protocol):
    name: str
    #: the caller's registered buffers (DistributedStore hands its own in)
    buffers: RegisteredBuffers

    def put_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], replicas: int,
                 pin: bool) -> list[KeyStatus]: ...

    def get_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]: ...

    def get_bytes_many(self, keys: list[str]) -> list[bytes | None]: ...

    def exists_flags(self, keys: list[str]) -> list[int]: ...  # 1 present, 0 absent

    def size_many(self, keys: list[str]) -> list[int | None]: ...

    def remove_many(self, keys: list[str]) -> list[bool]: ...

    def remove_all(self) -> int: ...

    def register(self, buf: RegisteredBuffer) -> RegisteredBuffer: ...

    def unregister(self, buf: RegisteredBuffer) -> None: ...

    def metrics(self) -> PoolMetrics: ...

    def close(self) -> None: ...
