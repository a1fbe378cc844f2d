"""``DistributedStore``: the pool's client, in this package's style (typed exceptions for
single keys, one status per key for batches).

Two ways to open one:

- ``DistributedStore.embedded(dram_bytes, ...)``: the pool is a segment in this process
  (no etcd, no network); what a new user gets by default.
- ``DistributedStore.connect(etcd, auth_token=...)``: the pool is the ``mooncake-rs store``
  nodes registered in etcd; keys are placed on nodes by rendezvous hashing, bytes move
  over the transfer engine (see docs/store-service.md).

Values are given either as buffers (``put``/``get``) or as memory by address
(``put_from``/``get_into`` and the batch forms, a list of ``(ptr, size)`` pieces per key,
as Mooncake's API takes them); memory registered with ``register_buffer`` is read and
written in place.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._core import all_nonempty_str
from ..errors import BlockNotFound, InvalidArgument, StoreFull, TransferFailed
from ..net.spin_wait import DEFAULT_SPIN_US, spin_us_checked
from .backend import Backend
from .buffers import RegisteredBuffer, RegisteredBuffers, address_of
from .local import LocalBackend
from .metrics import PoolMetrics, prometheus_text
from .segment import DEFAULT_CHUNK_BYTES, ObjectSegment
from .status import KeyStatus

__all__ = ["DistributedStore"]

Pieces = list[int]


def _check_key(key: object) -> str:
    """``key`` as a plain str; InvalidArgument unless it is a non-empty str. A str subclass
    (``numpy.str_``, a ``StrEnum`` member) comes back as the plain str of its characters:
    the wire's msgpack encoder takes str itself only, and the pool compares keys by value."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"a pool key is a non-empty str, got {key!r}")
    return key if key.__class__ is str else str.__str__(key)


def _check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each checked as ``_check_key`` does (one pass, no call per key)."""
    keys = list(keys)
    if not all_nonempty_str(keys):  # (one Rust pass; the per-key check below names a bad key)
        keys = [_check_key(k) for k in keys]
    return keys


def _check_replicas(replicas: object) -> None:
    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidArgument(f"replicas must be an int >= 1, got {replicas!r}")


def _raise_for(status: int, key: str) -> None:
    if status == KeyStatus.MISSING:
        raise BlockNotFound(f"key {key!r} is not in the pool")
    if status == KeyStatus.NO_SPACE:
        raise StoreFull(f"no room for {key!r}: every slot is pinned, leased or reserved, or the value exceeds "
                        "a node's segment; remove keys or add store nodes")
    if status == KeyStatus.INVALID:
        raise InvalidArgument(f"invalid request for {key!r} (a buffer smaller than the value?)")
    if status in (KeyStatus.TRANSFER_FAILED, KeyStatus.RPC_FAILED):
        raise TransferFailed(f"moving {key!r} failed ({KeyStatus(status).name}); retry, or check the store nodes")


class DistributedStore:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._buffers = RegisteredBuffers()
        backend.buffers = self._buffers  # the backend finds the caller's registered regions here
        self._lock = threading.Lock()
        self.closed = False

    # ---- opening
    @classmethod
    def embedded(cls, dram_bytes: int, *, ssd_path: str | None = None, ssd_bytes: int = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, eviction: str = "lru") -> "DistributedStore":
        seg = ObjectSegment(dram_bytes, ssd_path=ssd_path, ssd_bytes=ssd_bytes, chunk_bytes=chunk_bytes,
                            eviction=eviction)
        return cls(LocalBackend(seg))

    @classmethod
    def connect(cls, etcd: str, *, auth_token: str | bytes | None = None, prefix: str = "/mooncake/default",
                name: str | None = None, wait_nodes: int = 1, timeout_s: float = 10.0,
                io_timeout_s: float = 5.0, transports: tuple[str, ...] = ("tcp", "shm"),
                tcp_connections: int | None = None, plaintext: bool = False,
                spin_us: int = DEFAULT_SPIN_US) -> "DistributedStore":
        """``transports``: ("tcp",) makes every byte cross TCP even to a node on this host.
        ``tcp_connections``: data connections per node; each is sealed and opened on its own
        thread at both ends (one runs at about one core's AES-GCM), so more use more cores.
        None (default): the transfer engine's rule (without a token 2 where this process may
        use two cores, else 1; with one, half the cores, 1 to 4: docs/transfer.md).
        ``plaintext``: nodes started with ``--plaintext`` (no token: nothing authenticated or
        sealed, like Mooncake Store's TCP; only where every host is trusted).
        ``spin_us``: how long a call polls for a node's answer before it sleeps (net/spin_wait.py:
        saves waking this thread from another CPU per small call; 0: sleep at once)."""
        from .remote import RemoteBackend

        if tcp_connections is not None and (not isinstance(tcp_connections, int) or not 1 <= tcp_connections <= 64):
            raise InvalidArgument(f"tcp_connections must be an int in 1..64, got {tcp_connections!r}")
        return cls(RemoteBackend(etcd, auth_token=auth_token, prefix=prefix, name=name, wait_nodes=wait_nodes,
                                 timeout_s=timeout_s, io_timeout_s=io_timeout_s, transports=tuple(transports),
                                 tcp_connections=tcp_connections, plaintext=bool(plaintext),
                                 spin_us=spin_us_checked(spin_us, "spin_us")))

    # ---- buffers
    def register_buffer(self, ptr: int, size: int) -> None:
        if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
            raise InvalidArgument(f"register_buffer takes a positive address and size, got {ptr!r}, {size!r}")
        self._buffers.add(self._backend.register(RegisteredBuffer(ptr, size)))

    def unregister_buffer(self, ptr: int) -> bool:
        buf = self._buffers.remove(ptr)
        if buf is None:
            return False
        self._backend.unregister(buf)
        return True

    @property
    def buffers(self) -> RegisteredBuffers:
        return self._buffers

    # ---- batch calls (per-key results)
    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[Pieces], sizes: Sequence[Pieces], *,
                       replicas: int = 1, pin: bool = False) -> list[KeyStatus]:
        """Stores each key's value from its pieces (``ptrs[i][j]``, ``sizes[i][j]``), if the
        key is not in the pool yet (a stored key is left as it is: OK)."""
        keys = _check_keys(keys)
        if not (len(keys) == len(ptrs) == len(sizes)):
            raise InvalidArgument(f"keys, ptrs and sizes differ in length: {len(keys)}, {len(ptrs)}, {len(sizes)}")
        _check_replicas(replicas)
        return self._backend.put_many(keys, [list(p) for p in ptrs], [list(s) for s in sizes], replicas, pin)

    def batch_put_values(self, keys: Sequence[str], values: Sequence[Any], *, replicas: int = 1,
                         pin: bool = False) -> list[KeyStatus]:
        """Stores each key's value given as a buffer (bytes, numpy, memoryview...)."""
        keys = _check_keys(keys)
        if len(keys) != len(values):
            raise InvalidArgument(f"keys and values differ in length: {len(keys)}, {len(values)}")
        _check_replicas(replicas)
        if any(memoryview(v).nbytes == 0 for v in values):
            raise InvalidArgument("an empty value cannot be stored")
        fast = getattr(self._backend, "put_values", None)
        if fast is not None:
            return fast(keys, list(values), replicas, pin)
        held = [address_of(v) for v in values]
        return self._backend.put_many(keys, [[p] for _, p in held], [[a.size] for a, _ in held], replicas, pin)

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[Pieces], sizes: Sequence[Pieces]) -> list[int]:
        """Reads each key into its pieces: the value's size, or a negative KeyStatus."""
        keys = _check_keys(keys)
        if not (len(keys) == len(ptrs) == len(sizes)):
            raise InvalidArgument(f"keys, ptrs and sizes differ in length: {len(keys)}, {len(ptrs)}, {len(sizes)}")
        return self._backend.get_many(keys, [list(p) for p in ptrs], [list(s) for s in sizes])

    def batch_get_bytes(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each value as bytes, None for a key missing (or lost while read)."""
        keys = _check_keys(keys)
        return self._backend.get_bytes_many(keys)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return list(map((1).__eq__, self._backend.exists_flags(_check_keys(keys))))

    def batch_exists_flags(self, keys: Sequence[str]) -> list[int]:
        """``batch_exists`` as 1 (present) / 0 (absent) a key: Mooncake's ``batch_is_exist``
        codes, with no per-key conversion."""
        return self._backend.exists_flags(_check_keys(keys))

    def batch_sizes(self, keys: Sequence[str]) -> list[int | None]:
        return self._backend.size_many(_check_keys(keys))

    def batch_remove(self, keys: Sequence[str]) -> list[bool]:
        return self._backend.remove_many(_check_keys(keys))

    # ---- single keys (typed exceptions)
    def put(self, key: str, value: Any, *, replicas: int = 1, pin: bool = False) -> None:
        _raise_for(self.put_status(key, value, replicas, pin), key)

    def put_status(self, key: str, value: Any, replicas: int = 1, pin: bool = False) -> KeyStatus:
        """``batch_put_values([key], [value])[0]`` (the key's status; InvalidArgument for a bad
        key, replica count or an empty value), without the batch's lists where the backend
        has a single-key path (a small value to a one-node pool: remote.py ``put_one``)."""
        if key.__class__ is not str or not key:
            key = _check_key(key)
        _check_replicas(replicas)
        if (len(value) if value.__class__ is bytes else memoryview(value).nbytes) == 0:
            raise InvalidArgument(f"an empty value cannot be stored (key {key!r})")
        one = getattr(self._backend, "put_one", None)
        if one is None:
            return self.batch_put_values([key], [value], replicas=replicas, pin=pin)[0]
        return one(key, value, replicas, pin)

    def put_from(self, key: str, ptr: int, size: int, *, replicas: int = 1, pin: bool = False) -> None:
        _raise_for(self.batch_put_from([key], [[ptr]], [[size]], replicas=replicas, pin=pin)[0], key)

    def get(self, key: str) -> bytes:
        value = self.get_or_none(key)
        if value is None:
            raise BlockNotFound(f"key {key!r} is not in the pool")
        return value

    def get_or_none(self, key: str) -> bytes | None:
        """``batch_get_bytes([key])[0]``: the value, None when missing; without the batch's
        lists where the backend has a single-key path (remote.py ``get_one``)."""
        if key.__class__ is not str or not key:
            key = _check_key(key)
        one = getattr(self._backend, "get_one", None)
        return one(key) if one is not None else self._backend.get_bytes_many([key])[0]

    def get_into(self, key: str, ptr: int, size: int) -> int:
        got = self.batch_get_into([key], [[ptr]], [[size]])[0]
        if got < 0:
            _raise_for(got, key)
        return got

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def size(self, key: str) -> int:
        n = self.batch_sizes([key])[0]
        if n is None:
            raise BlockNotFound(f"key {key!r} is not in the pool")
        return n

    def remove(self, key: str) -> bool:
        return self.batch_remove([key])[0]

    def remove_all(self) -> int:
        return self._backend.remove_all()

    # ---- state
    def metrics(self) -> PoolMetrics:
        return self._backend.metrics()

    def metrics_text(self) -> str:
        return prometheus_text(self.metrics())

    @property
    def backend(self) -> Backend:
        return self._backend

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for buf in self._buffers.all():
            self._buffers.remove(buf.ptr)
            self._backend.unregister(buf)
        self._backend.close()

    def __enter__(self) -> "DistributedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
