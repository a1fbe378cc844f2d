"""``ServingConfig``: how a deployment routes requests and, for an embedded ``Cluster``,
what instances it runs. One frozen value, checked once when it is made (a bad value
raises ``InvalidArgument`` naming the field), built the same way from either command
line (``from_args``: ``serve --model`` and the conductor service ``serve --etcd``) and
from ``Cluster``'s keywords.

The routing fields (policy, SLOs, rejection, prefix reuse, multipath, seed, heartbeat)
are the conductor service's too; the instance fields (counts, memory, processes...)
only an embedded cluster reads: across hosts each worker brings its own (docs/deploy.md).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core import ConductorConfig
from ..errors import InvalidArgument

__all__ = ["ServingConfig", "HEARTBEAT_ACROSS_HOSTS_S"]

#: the heartbeat timeout of the conductor service (``serve --etcd``) unless told: a
#: worker across hosts is dropped sooner than an embedded instance (10 s)
HEARTBEAT_ACROSS_HOSTS_S = 5.0


def _positive(name: str, v: Any, *, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise InvalidArgument(f"{name} must be a positive number of seconds{' or None' if none_ok else ''}, "
                              f"got {v!r}")


def _count(name: str, v: Any, least: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise InvalidArgument(f"{name} must be an int >= {least}, got {v!r}")


@dataclass(frozen=True)
class ServingConfig:
    # ---- routing: an embedded cluster and the conductor service alike
    policy: str = "mooncake"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 1.0
    rejection: str = "none"
    #: False: no KV reuse, every prompt computed (baselines)
    prefix_reuse: bool = True
    #: a prefix fetch reads from every prefill instance holding it at once (multisource.py)
    multipath: bool = False
    seed: int = 0
    #: how long a silent instance may go before it is declared down (None: no watchdog;
    #: an embedded cluster only)
    heartbeat_timeout_s: float | None = 10.0
    #: KV block size in tokens (across hosts: the workers' own, which they register)
    block_size: int = 16
    # ---- an embedded cluster's instances
    prefill: int = 2
    decode: int = 1
    dram_bytes_per_instance: int = 64 << 20
    ssd_path: str | None = None
    #: None: 4x the DRAM when ``ssd_path`` is given
    ssd_bytes_per_instance: int | None = None
    processes: bool = False
    stream_layers: bool = True
    #: passed to each instance's Engine (read-only here)
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: bytes/s: emulate a network link between instances (benchmarks)
    link_bandwidth: float | None = None
    kv_events: str | Mapping[str, str] | None = None
    kv_grants: bool = False
    start_timeout_s: float = 180.0
    #: seconds between rounds of hot-prefix replication (the conductor's replica hints
    #: acted on: serving/replication.py); None: never on its own (``Cluster.replicate_hot_prefixes``)
    replicate_every_s: float | None = None
    #: bytes of KV one round may copy, and may have in flight, at most
    replica_max_bytes: float = 64e9

    def __post_init__(self) -> None:
        for n in (self.prefill, self.decode):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InvalidArgument(f"a cluster needs prefill >= 1 and decode >= 1 instances, got prefill="
                                      f"{self.prefill!r}, decode={self.decode!r}")
        _count("block_size", self.block_size, 1)
        _count("dram_bytes_per_instance", self.dram_bytes_per_instance, 1)
        _count("seed", self.seed, 0)
        if self.ssd_bytes_per_instance is not None:
            _count("ssd_bytes_per_instance", self.ssd_bytes_per_instance, 0)
        _positive("ttft_slo_s", self.ttft_slo_s)
        _positive("tbt_slo_s", self.tbt_slo_s)
        # the policy and admission names are the conductor's (the Rust core checks them)
        ConductorConfig(**self.conductor_args(self.block_size))
        _positive("heartbeat_timeout_s", self.heartbeat_timeout_s, none_ok=True)
        _positive("start_timeout_s", self.start_timeout_s)
        _positive("replicate_every_s", self.replicate_every_s, none_ok=True)
        if isinstance(self.replica_max_bytes, bool) or not isinstance(self.replica_max_bytes, (int, float)) or not (
                0 <= self.replica_max_bytes < math.inf):
            raise InvalidArgument(f"replica_max_bytes must be a finite number of bytes >= 0, got {self.replica_max_bytes!r}")
        if self.link_bandwidth is not None and (isinstance(self.link_bandwidth, bool) or not isinstance(
                self.link_bandwidth, (int, float)) or not 0 < self.link_bandwidth < math.inf):
            raise InvalidArgument(f"link_bandwidth must be a positive number of bytes/s or None, "
                                  f"got {self.link_bandwidth!r}")
        if not isinstance(self.engine_kwargs, Mapping):
            raise InvalidArgument(f"engine_kwargs must be a dict, got {type(self.engine_kwargs).__name__}")
        # frozen all the way down: the keywords as given, not a dict a caller still holds
        _set = object.__setattr__  # frozen: the normalised values once, here
        _set(self, "engine_kwargs", types.MappingProxyType(dict(self.engine_kwargs)))
        _set(self, "prefix_reuse", bool(self.prefix_reuse))
        _set(self, "multipath", bool(self.multipath))
        _set(self, "processes", bool(self.processes))
        _set(self, "stream_layers", bool(self.stream_layers))
        _set(self, "kv_grants", bool(self.kv_grants))
        _set(self, "ttft_slo_s", float(self.ttft_slo_s))
        _set(self, "tbt_slo_s", float(self.tbt_slo_s))
        if self.heartbeat_timeout_s is not None:
            _set(self, "heartbeat_timeout_s", float(self.heartbeat_timeout_s))

    @property
    def ssd_bytes(self) -> int:
        """Each instance's SSD tier (0: none)."""
        if self.ssd_path is None:
            return 0
        return 4 * self.dram_bytes_per_instance if self.ssd_bytes_per_instance is None else self.ssd_bytes_per_instance

    def conductor_args(self, block_size: int, dram_bytes: int | None = None) -> dict[str, Any]:
        """``ConductorConfig``'s keywords of this configuration (routing/routed.py adds the
        cost models), for instances of ``block_size`` tokens a block whose stores hold
        ``dram_bytes`` of DRAM (None: ``dram_bytes_per_instance``)."""
        return dict(block_size=block_size, ttft_slo_s=self.ttft_slo_s, tbt_slo_s=self.tbt_slo_s,
                    policy=self.policy, rejection=self.rejection, seed=self.seed,
                    hot_replica_max_bytes=float(self.replica_max_bytes),
                    # a prefix fetched at acceptance lands in the instance's own store, so
                    # the room for prefetches is that store's DRAM, not the core's default
                    prefetch_staging_bytes=float(self.dram_bytes_per_instance if dram_bytes is None else dram_bytes))

    @classmethod
    def from_args(cls, args: Any) -> "ServingConfig":
        """The configuration of parsed ``serve`` arguments, embedded (``--model``) or across
        hosts (``--etcd``): every flag maps to its field here, and only here."""
        engine: dict[str, Any] = {}
        if args.dtype:
            engine["dtype"] = args.dtype
        if args.device:
            engine["device"] = args.device
        heartbeat = args.heartbeat_timeout
        if heartbeat is None:
            heartbeat = HEARTBEAT_ACROSS_HOSTS_S if args.etcd else cls.heartbeat_timeout_s
        return cls(policy=args.policy, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo, rejection=args.rejection,
                   prefix_reuse=not args.no_prefix_reuse, multipath=args.multipath,
                   replicate_every_s=args.replicate_every, replica_max_bytes=args.replica_max_bytes,
                   seed=args.seed, heartbeat_timeout_s=heartbeat, block_size=args.block_size or cls.block_size,
                   prefill=args.prefill, decode=args.decode, dram_bytes_per_instance=args.dram_bytes,
                   ssd_path=args.ssd_path, processes=args.processes, engine_kwargs=engine)
