"""What a worker announces in etcd, and how the keys are laid out.

One key per worker, ``{prefix}/workers/{name}``, held under the worker's lease (it goes
when the worker revokes the lease on shutdown, or when the lease expires after a crash),
its value a JSON-encoded :class:`WorkerRecord` (JSON rather than msgpack so that
``etcdctl get --prefix`` shows a deployment to its operator). The leader of the
``serve`` processes holds ``{prefix}/leader`` the same way.

A record is decoded strictly (unknown fields ignored, wrong types refused) with
:func:`decode_record`; a malformed one is a ``InvalidArgument`` the watcher logs and
skips, never a crash.
"""

from __future__ import annotations

import msgspec

from ..errors import InvalidArgument

__all__ = ["ModelFingerprint", "WorkerRecord", "RECORD_VERSION", "worker_key", "workers_prefix", "leader_key",
           "encode_record", "decode_record"]

RECORD_VERSION = 1


class ModelFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """What must be equal for two instances' KV to be interchangeable: a block computed by
    one must mean the same to the other. Workers whose fingerprint differs from the
    cluster's are refused at registration (their KV never mixes)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hash_seed: int = 0
    hash_extra: str = ""

    def mismatch(self, other: "ModelFingerprint") -> str | None:
        """None if equal, else which fields differ (for the refusal message)."""
        diffs = [f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}"
                 for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]
        return "; ".join(diffs) or None


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as etcd knows it."""

    name: str
    role: str  # "prefill" or "decode"
    control: str  # HOST:PORT of its control endpoint
    transfer: str  # HOST:PORT of its transfer engine
    fingerprint: ModelFingerprint
    block_bytes: int
    capacity_blocks: int
    version: int = RECORD_VERSION

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise InvalidArgument(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.name or "/" in self.name:
            raise InvalidArgument(f"a worker name is non-empty and has no '/', got {self.name!r}")


def workers_prefix(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/workers/".encode()


def worker_key(prefix: str, name: str) -> bytes:
    return workers_prefix(prefix) + name.encode()


def leader_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/leader".encode()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerRecord)


def encode_record(record: WorkerRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> WorkerRecord:
    try:
        rec = _decoder.decode(data)
    except (msgspec.DecodeError, ValueError) as e:
        raise InvalidArgument(f"malformed worker record in etcd: {e}") from e
    if rec.version != RECORD_VERSION:
        raise InvalidArgument(f"worker record version {rec.version}, this build reads {RECORD_VERSION}")
    return rec
