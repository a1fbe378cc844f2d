"""What a worker announces in etcd, and how the keys are laid out: shared by the
deployment's processes (deploy/) and its clients (``RemoteCluster`` finds the leader
here).

One key per worker, ``{prefix}/workers/{name}``, held under the worker's lease (it goes
when the worker revokes the lease on shutdown, or when the lease expires after a crash),
its value a JSON-encoded :class:`WorkerRecord` (JSON rather than msgpack so that
``etcdctl get --prefix`` shows a deployment to its operator). The leader of the
``serve`` processes holds ``{prefix}/leader`` the same way.

A record is decoded strictly (unknown fields ignored, wrong types refused) with
:func:`decode_record`; a malformed one is a ``InvalidArgument`` the watcher logs and
skips, never a crash.

etcd is not a trust anchor: whoever can write to it could otherwise announce a relay as
a worker's control address, or as the leader. So records are signed with a key derived
from the cluster token (:func:`records_key`): HMAC-SHA256 over the etcd key, the record
(name, role, addresses, fingerprint, sizes) and the id of the lease it was put under.
Readers that hold the token (membership.py, the client's leader lookup) verify the
signature and that the key really sits under that lease (:func:`verify_record`), and
ignore and log a record that fails: a copy under another name, another address, an old
record put back under another lease. The cluster's model fingerprint
(``{prefix}/fingerprint``, no lease: it outlives the workers) is signed the same way over
its key (:func:`sign_fingerprint`): a worker ignores one that does not verify and puts
its own in its place, so an etcd writer cannot keep workers from joining with a forged
fingerprint of another model.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from ..errors import InvalidArgument

__all__ = ["cluster_prefix", "ModelFingerprint", "WorkerRecord", "LeaderRecord", "RECORD_VERSION", "worker_key", "workers_prefix",
           "leader_key", "encode_record", "decode_record", "records_key", "sign_record", "verify_record",
           "encode_leader", "decode_leader",
           "SignedFingerprint", "sign_fingerprint", "verify_fingerprint"]

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
    #: the etcd lease the record was put under, and its signature (hex; sign_record)
    lease: int = 0
    signature: str = ""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise InvalidArgument(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.name or "/" in self.name:
            raise InvalidArgument(f"a worker name is non-empty and has no '/', got {self.name!r}")

    def same_worker(self, other: "WorkerRecord") -> bool:
        """Equal but for the lease and signature: the same worker, registered again (after
        an etcd outage lapsed its lease) rather than a new one."""
        return msgspec.structs.replace(self, lease=0, signature="") == \
            msgspec.structs.replace(other, lease=0, signature="")


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What ``{prefix}/leader`` holds: the leading ``serve``'s client address, signed."""

    address: str
    lease: int = 0
    signature: str = ""


def cluster_prefix(cluster: str) -> str:
    """The etcd key prefix of a named cluster."""
    if not cluster or "/" in cluster:
        raise InvalidArgument(f"a cluster name is non-empty and has no '/', got {cluster!r}")
    return f"/mooncake/{cluster}"


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


# ---- signatures (the cluster token's, never etcd's)
_leader_decoder = msgspec.json.Decoder(LeaderRecord)


def records_key(token: str | bytes) -> bytes:
    """The key records are signed with: derived from the cluster token (so a signature
    reveals nothing usable for the control handshake, and the other way round)."""
    tok = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(tok, b"mooncake_rs etcd records v1", hashlib.sha256).digest()


def _mac(key: bytes, etcd_key: bytes, unsigned: bytes) -> str:
    return hmac.new(key, len(etcd_key).to_bytes(4, "big") + etcd_key + unsigned, hashlib.sha256).hexdigest()


def sign_record(record: "WorkerRecord | LeaderRecord", key: bytes, etcd_key: bytes, lease: int) -> bytes:
    """The value to put at ``etcd_key`` under ``lease``: the record with both set."""
    unsigned = msgspec.structs.replace(record, lease=lease, signature="")
    return _encoder.encode(msgspec.structs.replace(unsigned, signature=_mac(key, etcd_key,
                                                                            _encoder.encode(unsigned))))


def verify_record(record: "WorkerRecord | LeaderRecord", key: bytes, etcd_key: bytes, kv_lease: int) -> str | None:
    """None if ``record`` was signed with ``key`` for ``etcd_key`` and sits under the
    lease it names; else why not (for the log)."""
    if not record.signature:
        return "unsigned (written by something that does not hold the cluster token)"
    want = _mac(key, etcd_key, _encoder.encode(msgspec.structs.replace(record, signature="")))
    if not hmac.compare_digest(want, record.signature):
        return "its signature does not match (forged, altered, or copied from another key)"
    if record.lease == 0 or record.lease != kv_lease:
        return f"signed for lease {record.lease:x}, found under lease {kv_lease:x} (replayed)"
    return None


def encode_leader(address: str, key: bytes | None, etcd_key: bytes, lease: int) -> bytes:
    if key is None:
        return address.encode()
    return sign_record(LeaderRecord(address=address), key, etcd_key, lease)


def decode_leader(value: bytes, key: bytes | None, etcd_key: bytes, kv_lease: int) -> str:
    """The leader's address; ``InvalidArgument`` saying why when it does not verify."""
    if key is None:
        try:
            return _leader_decoder.decode(value).address
        except (msgspec.DecodeError, ValueError):
            return value.decode(errors="replace")
    try:
        rec = _leader_decoder.decode(value)
    except (msgspec.DecodeError, ValueError) as e:
        raise InvalidArgument(f"the leader record in etcd is not a signed record: {e}") from e
    why = verify_record(rec, key, etcd_key, kv_lease)
    if why is not None:
        raise InvalidArgument(f"the leader record in etcd ({rec.address}) is refused: {why}")
    return rec.address


class SignedFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """``{prefix}/fingerprint`` in a cluster with a token: the fingerprint and its signature."""

    fingerprint: ModelFingerprint
    signature: str = ""


_fingerprint_decoder = msgspec.json.Decoder(SignedFingerprint)


def sign_fingerprint(fingerprint: ModelFingerprint, key: bytes, etcd_key: bytes) -> bytes:
    """The value to put at ``etcd_key`` (the cluster's fingerprint key), signed."""
    return _encoder.encode(SignedFingerprint(fingerprint=fingerprint,
                                             signature=_mac(key, etcd_key, _encoder.encode(fingerprint))))


def verify_fingerprint(value: bytes, key: bytes, etcd_key: bytes) -> tuple[ModelFingerprint | None, str | None]:
    """(the fingerprint, None) when ``value`` was signed with ``key`` for ``etcd_key``;
    else (None, why not, for the log)."""
    try:
        rec = _fingerprint_decoder.decode(value)
    except (msgspec.DecodeError, ValueError):
        return None, "not a signed fingerprint (written by something that does not hold the cluster token)"
    want = _mac(key, etcd_key, _encoder.encode(rec.fingerprint))
    if not rec.signature or not hmac.compare_digest(want, rec.signature):
        return None, "its signature does not match (forged, altered, or copied from another cluster)"
    return rec.fingerprint, None
