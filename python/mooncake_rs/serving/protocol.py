"""The serving control protocol: one frozen message type per op, msgpack on the wire.

Every message between the cluster, its instances and instance peers is a
``msgspec.Struct`` of this module, tagged by its ``op`` field (one tagged union,
``Message``). On a socket a message travels as one frame (net/framing.py: a 4-byte
big-endian length, then the msgpack body; a frame longer than ``MAX_FRAME`` is refused
before its body is read). In-process channels pass the Struct objects themselves (nothing to encode).

Decoding never runs code from the peer (no pickle): the decoder builds only the types
named here, with their declared field types, and rejects unknown fields (a request's
``SamplingParams``, the public dataclass itself on the wire, ignores them and
validates its values as its constructor does). Whatever is
wrong with a frame (too long, truncated, not msgpack, an unknown op, a field of the
wrong type) raises ``ProtocolError``; a channel reader that gets one closes that
connection with the reason logged (see control.py), which the cluster treats as the
instance's death. ``PROTOCOL_VERSION`` is checked on the init/ready exchange.

Block hashes are 128-bit, beyond msgpack's integers, so they travel as ``bytes`` of
16-byte little-endian keys (``pack_keys`` / ``unpack_keys``): an opaque buffer.

Directions (see docs/serving.md for the flow and the hop count):
cluster -> instance: ``Init`` (socket only), ``Expect``, ``Export``, ``Unpin``, ``Replicate``,
``Cancel``, ``Stats``, ``Measure``, ``Stop``, ``SwitchRole``; instance -> cluster: ``Ready``,
``InitFailed``, ``Beat``, ``StoreEvents``, ``Exported``, ``Fetched``, ``Started``, ``Tokens``, ``Step``,
``Failed``, ``Cancelled``, ``PeerLost``, ``StatsReply``, ``Timings``, ``RoleSwitched``; decode -> prefill:
``Prefill``; prefill -> decode: ``KvReady``. Across hosts (deploy/): conductor service ->
worker ``Attach`` first (instead of ``Init``), and peer messages go through the service
as ``Relay``.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import msgspec

from .._core import BlockHashes
from ..base.params import SamplingParams
from ..net import framing
from ..net.framing import MAX_FRAME, ProtocolError, op_of

__all__ = [
    "PROTOCOL_VERSION", "MAX_FRAME", "ProtocolError", "Message", "TO_INSTANCE", "FROM_INSTANCE", "PEER",
    "Endpoint", "Fetch", "Dest", "PrefillReport", "InstanceSpec",
    "Init", "Attach", "Relay", "TO_REMOTE", "FROM_REMOTE", "Ready", "InitFailed", "Beat", "Expect", "Export",
    "Exported", "Unpin", "Replicate", "Prefill", "Fetched", "Started",
    "KvReady", "Tokens", "Step", "Failed", "Cancel", "Cancelled", "PeerLost", "StoreEvents", "Stats", "StatsReply", "Measure",
    "Timings", "Stop", "SwitchRole", "RoleSwitched", "Codec", "pack_keys", "unpack_keys", "op_of",
]

PROTOCOL_VERSION = 1


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block hashes (128-bit ints) as one buffer of 16-byte little-endian keys: the bytes
    of a ``BlockHashes``, which is what the request path sends (``bytes(hashes)``)."""
    return bytes(BlockHashes(list(keys)))


def unpack_keys(buf: bytes) -> list[int]:
    """The ints of a key buffer (for tests and logs; the request path reads a buffer as
    ``BlockHashes(buf)`` and builds no int per block)."""
    return BlockHashes(buf).tolist()


def _check_keys(buf: bytes) -> None:
    if len(buf) % 16:
        raise ValueError(f"a key buffer must be a multiple of 16 bytes, got {len(buf)}")


def _check_fetch_also(fetch: Any, also: Sequence[Any], split: Sequence[int]) -> None:
    """The extra holders of a multi-source fetch: each names the same run as ``fetch``
    (every holder pinned all of it, so any of them can be read for any block), and the
    split, if given, has one count per source (``fetch`` first) adding up to the run."""
    if not also and not split:
        return
    if fetch is None:
        raise ValueError("fetch_also / fetch_split need a primary fetch")
    for f in also:
        if f.keys != fetch.keys:
            raise ValueError(f"holder {f.holder} of fetch_also names another run than holder {fetch.holder}")
    n = len(fetch.keys) // 16
    if split and (len(split) != 1 + len(also) or sum(split) != n or min(split) < 0):
        raise ValueError(f"fetch_split {list(split)} must give one count >= 0 per source "
                         f"({1 + len(also)}) adding up to the run ({n} blocks)")


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class _Msg(_Base, frozen=True, tag_field="op"):
    pass


# ---- value types carried inside messages
class Endpoint(_Base, frozen=True):
    """Where a peer's transfer engine and arena are: ``Transport`` connects by name
    (in-process) or address (a worker) and addresses slots in ``region``."""

    name: str
    address: str
    region: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "region": self.region}


class Fetch(_Base, frozen=True):
    """A prefix to copy from a holder's arena: the blocks ``keys`` at ``offsets``."""

    holder: int
    arena: Endpoint
    offsets: list[int]
    keys: bytes

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if len(self.offsets) != len(self.keys) // 16:
            raise ValueError("a fetch needs one offset per key")


class Dest(_Base, frozen=True):
    """The decode instance's slots for a request: one offset per full prompt block
    (None: it already holds that block) and one for the partial last block."""

    arena: Endpoint
    blocks: list[Union[int, None]]
    partial: Union[int, None]


class PrefillReport(_Base, frozen=True, omit_defaults=True):
    """What the prefill of one request did (for its ``RequestMetrics``). ``sources``: the
    holders its prefix fetch read from (0: no fetch; 2 or more: a multi-source fetch),
    ``fetch_s`` how long that fetch took (from its start to its last block in); both
    additive and left off the wire at their defaults, so a report without them decodes
    the same on either side (no version bump). ``busy_s``: the instance's time spent on
    this request (its engine step and KV save, from when it joined the engine or the
    previous request's end, whichever is later; None from an instance that does
    not measure it): the real service cost
    the admission's calibration learns (docs/conductor.md)."""

    reused_blocks: int
    fetched_blocks: int
    bytes: int
    t_start: float
    t_compute: float
    t_ready: float
    sources: int = 0
    fetch_s: float = 0.0
    busy_s: float | None = None


class InstanceSpec(_Base, frozen=True):
    """What an instance is built from (sent to a worker process in ``Init``).

    ``model``: a preset name, a model directory, or a ModelConfig's fields as a dict."""

    id: int
    role: str  # "prefill" or "decode"
    name: str
    model: Union[str, dict[str, Any]]
    block_size: int
    dram_bytes: int
    seed: int = 0
    stream_layers: bool = True
    link_bandwidth: Union[float, None] = None
    engine_kwargs: dict[str, Any] = {}
    #: the store's SSD tier (a directory of this instance's own), or None for DRAM only
    ssd_path: Union[str, None] = None
    ssd_bytes: int = 0
    #: seconds between heartbeats of a worker process (0: none; in-process instances send none)
    heartbeat_s: float = 0.0
    #: KV events out (serving/kv_events.py): a prefill instance's PUB and replay ROUTER endpoints
    kv_events: Union[str, None] = None
    kv_events_replay: Union[str, None] = None
    #: a decode instance registers its arena ``restricted`` and grants each request's
    #: prefill write access to exactly its reserved slots (``Cluster(kv_grants=True)``)
    kv_grants: bool = False
    #: a worker's transfer engine: where it listens (``HOST:0``: any free port on the
    #: host its peers reach it at) and which transports it may use (None: local, shm
    #: and tcp; a deployment across hosts may say ``["tcp"]`` so KV never takes shm)
    transfer_listen: str = "127.0.0.1:0"
    transports: Union[list[str], None] = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")


# ---- start-up (socket only)
class Init(_Msg, frozen=True, tag="init"):
    """The first frame to a worker: what to build, the cluster's transfer token, and
    which inherited file descriptors are control links to which peer instances."""

    version: int
    spec: InstanceSpec
    auth_token: str
    peers: dict[int, int] = {}  # peer instance id -> fd
    #: ``kv_grants``: this instance's own transfer token (its engine runs with it instead
    #: of ``auth_token``), and every other instance's engine name -> its token (what this
    #: engine's server asks a client announcing that name to prove); empty: none
    token: str = ""
    peer_tokens: dict[str, str] = {}


class Ready(_Msg, frozen=True, tag="ready"):
    version: int
    arena: Endpoint
    pid: int
    block_bytes: int
    slots: int
    kv_tokens: int
    #: what a prompt must fit (a remote conductor knows no model config of its own):
    #: the vocabulary size and the model's context; 0 when not said
    vocab_size: int = 0
    max_positions: int = 0
    #: the engine's largest batch (``max_num_seqs``): a remote conductor's admission
    #: holds a decode instance to it; 0 when not said (a worker of an older version)
    max_num_seqs: int = 0


class Attach(_Msg, frozen=True, tag="attach"):
    """conductor service -> a worker of another host (deploy/), the first frame on a new
    control link: serve the cluster on this link as instance ``id`` (ids are the
    conductor's; a new leader gives new ones). The worker drops whatever requests it
    still holds for an earlier conductor, answers ``Ready`` and re-announces its store's
    contents (``StoreEvents``) so the new conductor's index starts out right."""

    version: int
    id: int
    name: str


class InitFailed(_Msg, frozen=True, tag="init_failed"):
    error: str


class Beat(_Msg, frozen=True, tag="beat"):
    """instance -> cluster, every ``InstanceSpec.heartbeat_s``: "alive", with the
    instance's memory use as of its last loop iteration (the cluster's KV gauges, read
    without a round trip). -1: not known yet (a beat before the instance is built). The
    fields are additive with defaults, so a bare ``Beat()`` still decodes: no version bump."""

    kv_pages: int = -1  # the engine's KV cache: pages (one block of tokens each) in all
    kv_free_pages: int = -1
    store_blocks: int = -1  # blocks the store holds in DRAM
    store_slots: int = -1  # its DRAM slots in all
    store_bytes: int = -1  # bytes of DRAM those blocks take
    running: int = -1  # the engine's scheduler: sequences running and waiting
    waiting: int = -1
    #: the instance's transfer engine: bytes of its transfers still queued or in flight
    #: on its NIC out (writes: KV streams to decode) and in (reads: prefix fetches), as
    #: of ``link_t`` (the instance's time.monotonic(); a reading's identity: a worker's
    #: beat thread re-sends the latest reading). ``link_age_s``: how old the reading was
    #: when the beat left, so the cluster dates it on its own clock (docs/conductor.md)
    link_out_bytes: float = -1.0
    link_in_bytes: float = -1.0
    link_t: float = -1.0
    link_age_s: float = 0.0


# ---- one request
class Expect(_Msg, frozen=True, tag="expect", omit_defaults=True):
    """cluster -> decode: reserve slots for the request's blocks, then hand the request
    to ``prefill`` (a ``Prefill`` on the peer link, with the slots).

    A multi-source fetch (``Cluster(multipath=True)``) names the other holders of the
    same run in ``fetch_also`` and the blocks each source sends in ``fetch_split``
    (``fetch`` first); decode passes both on in ``Prefill``. Fields at their defaults
    are left off the wire, so a message without them is what an older peer sends and
    reads (no version bump)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    keys: bytes  # every full prompt block's hash
    local: int  # leading blocks the prefill instance holds itself
    fetch: Union[Fetch, None]
    prefill: int
    #: the prefill's transfer engine name (what a ``kv_grants`` decode grants its slots to)
    prefill_name: str = ""
    #: the request's deadline (monotonic seconds of this host), None: none
    deadline: Union[float, None] = None
    #: other holders of ``fetch``'s run, and the blocks per source (see above)
    fetch_also: list[Fetch] = []
    fetch_split: list[int] = []
    #: the decision's ``prefetch``: start the fetch when the request reaches its prefill
    #: instance (True), or when the requests computing there before it are done (False:
    #: the conductor's staging room for the instance was full)
    prefetch: bool = True

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        _check_fetch_also(self.fetch, self.fetch_also, self.fetch_split)


class Prefill(_Msg, frozen=True, tag="prefill", omit_defaults=True):
    """decode -> prefill (peer link): compute the request, writing its KV into ``dest``.
    ``fetch_also`` / ``fetch_split``, ``prefetch``: as in ``Expect``."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    keys: bytes
    local: int
    fetch: Union[Fetch, None]
    dest: Dest
    decode: int
    fetch_also: list[Fetch] = []
    fetch_split: list[int] = []
    prefetch: bool = True

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        _check_fetch_also(self.fetch, self.fetch_also, self.fetch_split)


class KvReady(_Msg, frozen=True, tag="kv_ready"):
    """prefill -> decode (peer link): every byte of the request's KV is in ``dest``;
    ``first`` is the sampled first token; ``finish`` is ``"prefill"`` unless the request
    already ended (then decode only frees the slots and reports the end)."""

    rid: int
    first: Union[int, None]
    finish: str
    report: PrefillReport


class Relay(_Msg, frozen=True, tag="relay"):
    """A peer message carried through the conductor service (deploy/): a worker has one
    control link, to the conductor, and no links of its own to its peers. From a worker
    ``peer`` is the destination; to a worker it is the source."""

    peer: int
    msg: Union[Prefill, KvReady]


class Export(_Msg, frozen=True, tag="export"):
    """cluster -> holder: lease the longest held prefix of ``keys`` for the request."""

    rid: int
    keys: bytes

    def __post_init__(self) -> None:
        _check_keys(self.keys)


class Exported(_Msg, frozen=True, tag="exported"):
    rid: int
    arena: Endpoint
    offsets: list[int]


class Unpin(_Msg, frozen=True, tag="unpin"):
    rid: int


class Replicate(_Msg, frozen=True, tag="replicate"):
    """cluster -> prefill: copy ``fetch`` (a hot prefix its holder exported and pinned
    under ``rid``, a replication id, negative) into this instance's store, then answer
    ``Fetched(rid)`` (the holder may unpin) whether it came in or not."""

    rid: int
    fetch: Fetch


class Fetched(_Msg, frozen=True, tag="fetched"):
    """prefill -> cluster: the holder's blocks are copied (it may unpin them)."""

    rid: int


class Started(_Msg, frozen=True, tag="started"):
    """prefill -> cluster: the request went into the engine (its prefix is in: its fetch
    ended and the earlier requests here that make part of it stored their blocks). The
    conductor's prefill queue counts it as running from now (``on_prefill_started``)."""

    rid: int


class Tokens(_Msg, frozen=True, tag="tokens"):
    """decode -> cluster: new tokens of a request; ``finish`` ends it. The first one
    carries the first token and the prefill's ``report``."""

    rid: int
    tokens: list[int]
    finish: Union[str, None] = None
    report: Union[PrefillReport, None] = None


class Step(_Msg, frozen=True, tag="step"):
    """decode -> cluster: the ``Tokens`` of several requests at once (one engine step's,
    or the first tokens of one loop): one frame instead of one per request."""

    tokens: list[Tokens]


class Failed(_Msg, frozen=True, tag="failed"):
    rid: Union[int, None]
    error: str
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


class Cancel(_Msg, frozen=True, tag="cancel"):
    rid: int


class PeerLost(_Msg, frozen=True, tag="peer_lost"):
    """instance -> cluster: the peer link to ``peer`` closed (its end closed it, or it
    sent a bad frame) while this instance runs; the cluster fences that peer, so no
    request waits forever on a message that link can no longer carry."""

    peer: int
    reason: str


class Cancelled(_Msg, frozen=True, tag="cancelled"):
    """prefill -> cluster: the request is dropped and none of its copies is in flight."""

    rid: int


# ---- the index feed and housekeeping
class StoreEvents(_Msg, frozen=True, tag="store"):
    """A prefill instance's drained store events, in the store's own wire form
    (``mooncake_rs.StoreEvents.to_bytes()``: ``MCE1`` then 18 bytes an event), which the
    conductor decodes and validates itself (``Conductor.apply_store_events``)."""

    events: bytes


class Stats(_Msg, frozen=True, tag="stats"):
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


class StatsReply(_Msg, frozen=True, tag="stats_reply"):
    stats: dict[str, float]
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


class Measure(_Msg, frozen=True, tag="measure"):
    points: list[tuple[int, int]]
    repeats: int = 3
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


class Timings(_Msg, frozen=True, tag="timings"):
    timings: list[tuple[int, int, float]]
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


class Stop(_Msg, frozen=True, tag="stop"):
    pass


class SwitchRole(_Msg, frozen=True, tag="switch_role"):
    """cluster -> instance (``Cluster.switch_role``, serving/roles.py): once you hold no
    request, serve ``role`` ("prefill" or "decode") from now on. The conductor has
    drained the instance first, so nothing new comes meanwhile."""

    role: str
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")


class RoleSwitched(_Msg, frozen=True, tag="role_switched"):
    """instance -> cluster: it now serves ``role``; ``arena`` is its arena as peers
    reach it now (re-registered with the new role's rights)."""

    role: str
    arena: Endpoint
    #: the query this answers / asks (the cluster's own calls: stats, calibration, a role
    #: switch), so a reply finds its caller however the calls interleave (0: none)
    qid: int = 0


Message = Union[Init, Attach, Relay, Ready, InitFailed, Beat, Expect, Prefill, KvReady, Export, Exported, Unpin,
                Replicate, Fetched, Started, Tokens,
                Step, Failed, Cancel, Cancelled, PeerLost, StoreEvents, Stats, StatsReply, Measure, Timings, Stop,
                SwitchRole, RoleSwitched]

#: what each kind of link may carry (a reader closes a link that gets anything else)
TO_INSTANCE: tuple[type, ...] = (Init, Expect, Export, Unpin, Replicate, Cancel, Stats, Measure, Stop, SwitchRole)
FROM_INSTANCE: tuple[type, ...] = (Ready, InitFailed, Beat, StoreEvents, Exported, Fetched, Started, Tokens, Step,
                                   Failed,
                                   Cancelled, PeerLost, StatsReply, Timings, RoleSwitched)
#: a worker's control link to a conductor service across hosts (deploy/): peer messages
#: travel on it too, as ``Relay``
TO_REMOTE: tuple[type, ...] = (Attach, Relay, Expect, Export, Unpin, Replicate, Cancel, Stats, Measure, Stop)
FROM_REMOTE: tuple[type, ...] = FROM_INSTANCE + (Relay,)
PEER: tuple[type, ...] = (Prefill, KvReady)


class Codec(framing.Codec):
    """Frames the serving protocol's messages (``Message``) for one link, unless given
    another union (net/framing.py has the framing itself)."""

    def __init__(self, max_frame: int = MAX_FRAME, types: Any = Message) -> None:
        super().__init__(types, max_frame)
