"""The pool on one host with no etcd: one in-process ObjectSegment (the embedded default a
new user gets). Bytes move by memcpy between the caller's memory and the store's slots,
a whole batch in one Rust call per size class (segment_batch.py)."""

from __future__ import annotations

from .buffers import RegisteredBuffer, RegisteredBuffers
from .metrics import PoolMetrics, segment_metrics
from .segment import ObjectSegment
from .segment_batch import get_batch, put_batch
from .status import KeyStatus

__all__ = ["LocalBackend"]


class LocalBackend:
    def __init__(self, segment: ObjectSegment) -> None:
        self.segment = segment
        self.name = "local"
        self.buffers = RegisteredBuffers()

    def put_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], replicas: int,
                 pin: bool) -> list[KeyStatus]:
        return put_batch(self.segment, keys, ptrs, sizes, pin)

    def put_values(self, keys: list[str], values: list[object], replicas: int, pin: bool) -> list[KeyStatus]:
        seg = self.segment
        return [seg.put_value(k, v, pin) for k, v in zip(keys, values)]

    def get_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return get_batch(self.segment, keys, ptrs, sizes)

    def get_bytes_many(self, keys: list[str]) -> list[bytes | None]:
        out = []
        for k in keys:
            v = self.segment.get_bytes(k)
            out.append(v if isinstance(v, bytes) else None)
        return out

    def exists_flags(self, keys: list[str]) -> list[int]:
        self.segment.reap_evicted()
        return self.segment.exists_many(keys)

    def size_many(self, keys: list[str]) -> list[int | None]:
        return [self.segment.size_of(k) for k in keys]

    def remove_many(self, keys: list[str]) -> list[bool]:
        return [self.segment.remove(k) for k in keys]

    def remove_all(self) -> int:
        return self.segment.remove_all()

    def register(self, buf: RegisteredBuffer) -> RegisteredBuffer:
        return buf  # memcpy needs no registration

    def unregister(self, buf: RegisteredBuffer) -> None:
        pass

    def metrics(self) -> PoolMetrics:
        return segment_metrics(self.segment, nodes=1)

    def close(self) -> None:
        self.segment.flush()
