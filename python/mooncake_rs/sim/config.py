"""Simulator configuration (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._core import ConductorConfig, DecodeCostModel, PrefillCostModel, TransferCostModel
from ..errors import InvalidArgument
from .layouts import bytes_per_token, describe
from .trace import BLOCK_TOKENS

#: the conductor's own defaults (written once, in the Rust core): the simulator's conductor
#: options start from them
CONDUCTOR_DEFAULTS = ConductorConfig()

__all__ = ["SimConfig", "POLICIES", "REJECTIONS"]

#: The conductor's policies by name (the conductor validates them; this is the sweep list).
POLICIES = ("random", "load_balance", "local_cache_aware", "mooncake", "ttft_optimal")
#: The conductor's rejection modes.
REJECTIONS = ("none", "early", "predictive")


def _pos(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidArgument(f"{name} must be a positive finite number, got {v!r}")


def _posint(name: str, v: int, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {v!r}")


@dataclass
class SimConfig:
    """A simulated cluster.

    ``architecture="disaggregated"`` (Mooncake): ``prefill`` prefill instances and
    ``decode`` decode instances, the real :class:`~mooncake_rs.Conductor` routing.
    ``architecture="coupled"`` (the vLLM-like baseline): ``prefill + decode`` instances
    that each prefill and decode (same GPU count), with or without ``chunked_prefill``
    and local ``prefix_caching``.

    Cache: each prefill instance holds ``capacity_tokens_per_instance // block_tokens``
    blocks under the store's ``eviction`` policy (``None``: unbounded). ``cache="global"``
    lets an instance fetch a prefix held by another one (the conductor's decision);
    ``cache="local"`` reuses only what the instance holds itself.

    Times: the cost models give every duration (defaults: the conductor's, a
    LLaMA3-70B-class model on 8 GPUs); ``bandwidth`` (bytes/s) overrides the transfer
    model's network bandwidth; ``speedup`` divides every arrival time (2.0 = twice the
    load).
    """

    prefill: int = 16
    decode: int = 16
    cache: str = "global"
    capacity_tokens_per_instance: int | None = None
    eviction: str = "lru"
    policy: str = CONDUCTOR_DEFAULTS.policy
    rejection: str = CONDUCTOR_DEFAULTS.rejection
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    bandwidth: float | None = None
    prefill_model: PrefillCostModel | None = None
    transfer_model: TransferCostModel | None = None
    decode_model: DecodeCostModel | None = None
    speedup: float = 1.0
    seed: int = 0
    block_tokens: int = BLOCK_TOKENS
    balancing_threshold: float = CONDUCTOR_DEFAULTS.balancing_threshold
    #: decode instance limits (also given to the conductor)
    decode_max_batch: int = 128
    decode_kv_capacity_tokens: int = 1_500_000
    #: pass each request's true output length to the conductor (an oracle predictor)
    oracle_output_len: bool = False
    #: ours (beyond the paper): index a prompt's blocks on its prefill instance when it is
    #: scheduled, not when its prefill ends, so later requests with that prefix see it
    eager_index: bool = False
    #: act on the conductor's replication hints every this many seconds (None: never)
    replicate_every_s: float | None = None
    architecture: str = "disaggregated"
    chunked_prefill: bool = False
    chunk_tokens: int = 2048
    prefix_caching: bool = True
    #: hot-block replica sampling
    hot_sample_every_s: float = 10.0
    hot_top_k: int = 8
    # --- fidelity (docs/sim.md, "Ground truth and estimates"); all off by default ---
    #: the cost models the simulated instances really run on (None: the conductor's own)
    true_prefill_model: PrefillCostModel | None = None
    true_transfer_model: TransferCostModel | None = None
    true_decode_model: DecodeCostModel | None = None
    #: per-request relative error of the truth against the conductor's estimate: each
    #: request's prefill and transfer times are multiplied by exp(e*z - e*e/2) (mean 1),
    #: z ~ N(0, 1) drawn per request from ``seed`` (0.0: none)
    estimate_error: float = 0.0
    # --- links and the SSD tier (docs/sim.md, "Links and the SSD tier"); None: off ---
    #: each instance's NIC, bytes/s each way; concurrent transfers share it max-min fairly
    nic_bandwidth: float | None = None
    #: each instance's link to the SSD tier, bytes/s (reads and writes share it)
    storage_bandwidth: float | None = None
    #: SSD tier per prefill instance: what its DRAM evicts is demoted there (tokens)
    ssd_capacity_tokens_per_instance: int | None = None
    #: DualPath: split a prefix fetch across every holder and the decode instance's relay
    multipath: bool = False
    #: the model's KV layout (engine ``BlockLayout`` or ``sim.MLALayout``): bytes per
    #: token for every transfer come from it (None: the transfer model's)
    layout: Any = None
    #: let instances move between the prefill and the decode pool under ``role_policy``
    #: (docs/sim.md, "Adaptive roles"); disaggregated, without the link model
    adaptive_roles: bool = False
    #: a ``sim.RolePolicy`` (None: its defaults); used only with ``adaptive_roles``
    role_policy: Any = None
    #: with the link model on: the conductor prices fetches on the links as loaded
    #: (what it scheduled, corrected by the instances' reports every
    #: ``link_report_every_s``); False: on idle links, as before issue 25
    contention_aware: bool = CONDUCTOR_DEFAULTS.contention_aware
    #: how often (virtual seconds) every instance reports its links' backlog to the
    #: conductor (None: never; the conductor then counts only what it scheduled)
    link_report_every_s: float | None = 0.2
    #: with the link model on: a fetch still running when finishing it would be slower
    #: than recomputing is given up at the decision's ``fetch_abandon_s``
    abandon_late_fetches: bool = True
    #: replication (``replicate_every_s``): at most this many bytes of replicas per
    #: round (the conductor's ``hot_replica_max_bytes``)
    hot_replica_max_bytes: float = CONDUCTOR_DEFAULTS.hot_replica_max_bytes
    #: prefetch at decision time (disaggregated): bytes of staging DRAM per prefill
    #: instance for prefixes fetched while their request waits in the queue (the
    #: conductor's ``prefetch_staging_bytes``; 0: every fetch starts at dequeue)
    prefetch_staging_bytes: float = CONDUCTOR_DEFAULTS.prefetch_staging_bytes

    def __post_init__(self) -> None:
        _posint("prefill", self.prefill)
        _posint("decode", self.decode)
        if self.cache not in ("global", "local"):
            raise InvalidArgument(f"cache must be 'global' or 'local', got {self.cache!r}")
        _posint("block_tokens", self.block_tokens)
        if self.capacity_tokens_per_instance is not None:
            _posint("capacity_tokens_per_instance", self.capacity_tokens_per_instance, self.block_tokens)
        if self.policy not in POLICIES:
            raise InvalidArgument(f"unknown policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        if self.rejection not in REJECTIONS:
            raise InvalidArgument(f"unknown rejection {self.rejection!r}; expected one of {', '.join(REJECTIONS)}")
        _pos("ttft_slo_s", self.ttft_slo_s)
        _pos("tbt_slo_s", self.tbt_slo_s)
        if self.bandwidth is not None:
            _pos("bandwidth", self.bandwidth)
        _pos("speedup", self.speedup)
        _pos("balancing_threshold", self.balancing_threshold)
        if self.balancing_threshold < 1:
            raise InvalidArgument(f"balancing_threshold must be >= 1, got {self.balancing_threshold}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgument(f"seed must be an integer >= 0, got {self.seed!r}")
        _posint("decode_max_batch", self.decode_max_batch)
        _posint("decode_kv_capacity_tokens", self.decode_kv_capacity_tokens)
        if self.replicate_every_s is not None:
            _pos("replicate_every_s", self.replicate_every_s)
        if self.architecture not in ("disaggregated", "coupled"):
            raise InvalidArgument(f"architecture must be 'disaggregated' or 'coupled', got {self.architecture!r}")
        _posint("chunk_tokens", self.chunk_tokens)
        _pos("hot_sample_every_s", self.hot_sample_every_s)
        _posint("hot_top_k", self.hot_top_k, 0)
        if isinstance(self.estimate_error, bool) or not isinstance(self.estimate_error, (int, float)) or not (
            math.isfinite(self.estimate_error) and self.estimate_error >= 0
        ):
            raise InvalidArgument(f"estimate_error must be a finite number >= 0, got {self.estimate_error!r}")
        for name in ("nic_bandwidth", "storage_bandwidth"):
            if getattr(self, name) is not None:
                _pos(name, getattr(self, name))
        if self.ssd_capacity_tokens_per_instance is not None:
            _posint("ssd_capacity_tokens_per_instance", self.ssd_capacity_tokens_per_instance, self.block_tokens)
            if self.capacity_tokens_per_instance is None:
                raise InvalidArgument(
                    "ssd_capacity_tokens_per_instance needs capacity_tokens_per_instance (an unbounded DRAM never demotes)"
                )
        if self.layout is not None:
            bytes_per_token(self.layout)  # validates
        if not isinstance(self.multipath, bool):
            raise InvalidArgument(f"multipath must be a bool, got {self.multipath!r}")
        if self.multipath and self.nic_bandwidth is None:
            raise InvalidArgument("multipath=True needs nic_bandwidth (paths are split by their free bandwidth)")
        if self.links and self.architecture != "disaggregated":
            raise InvalidArgument(
                "nic_bandwidth, storage_bandwidth, ssd_capacity_tokens_per_instance and multipath"
                " model the disaggregated cluster only; use architecture='disaggregated'"
            )
        for name in ("contention_aware", "abandon_late_fetches"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.link_report_every_s is not None:
            _pos("link_report_every_s", self.link_report_every_s)
        p = self.prefetch_staging_bytes
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and p >= 0):
            raise InvalidArgument(f"prefetch_staging_bytes must be a finite number of bytes >= 0, got {p!r}")
        if not isinstance(self.adaptive_roles, bool):
            raise InvalidArgument(f"adaptive_roles must be a bool, got {self.adaptive_roles!r}")
        if self.adaptive_roles and (self.architecture != "disaggregated" or self.links):
            raise InvalidArgument(
                "adaptive_roles=True models the disaggregated cluster without the link model"
                " (architecture='disaggregated', no nic/storage bandwidth, SSD tier or multipath)"
            )
        if self.role_policy is not None:
            from .roles import RolePolicy

            if not isinstance(self.role_policy, RolePolicy):
                raise InvalidArgument(f"role_policy must be a sim.RolePolicy or None, got {type(self.role_policy).__name__}")
        for name, cls in (
            ("prefill_model", PrefillCostModel),
            ("transfer_model", TransferCostModel),
            ("decode_model", DecodeCostModel),
            ("true_prefill_model", PrefillCostModel),
            ("true_transfer_model", TransferCostModel),
            ("true_decode_model", DecodeCostModel),
        ):
            v = getattr(self, name)
            if v is not None and not isinstance(v, cls):
                raise InvalidArgument(f"{name} must be a {cls.__name__} or None, got {type(v).__name__}")
        # eviction names belong to the store: let it judge them
        from .._core import BlockCache

        BlockCache(1, self.eviction)
        self.conductor_config()  # the conductor validates the rest

    # --- derived ---

    @property
    def capacity_blocks(self) -> int | None:
        c = self.capacity_tokens_per_instance
        return None if c is None else c // self.block_tokens

    @property
    def ssd_blocks(self) -> int | None:
        c = self.ssd_capacity_tokens_per_instance
        return None if c is None else c // self.block_tokens

    @property
    def links(self) -> bool:
        """Whether the shared-link model (NICs, storage links, the SSD tier) is on."""
        return (
            self.nic_bandwidth is not None
            or self.storage_bandwidth is not None
            or self.ssd_capacity_tokens_per_instance is not None
            or self.multipath
        )

    def true_models(self) -> tuple[PrefillCostModel, TransferCostModel, DecodeCostModel]:
        """The models the simulated instances run on (the conductor's where not given)."""
        p, t, d = self.models()
        tt = self.true_transfer_model or t
        if self.layout is not None and self.true_transfer_model is not None:
            # the layout is a fact of the model: the truth moves its bytes too
            tt = TransferCostModel(
                bytes_per_token=bytes_per_token(self.layout),
                network_bandwidth=tt.network_bandwidth,
                ssd_bandwidth=tt.ssd_bandwidth,
                latency_s=tt.latency_s,
            )
        return self.true_prefill_model or p, tt, self.true_decode_model or d

    def models(self) -> tuple[PrefillCostModel, TransferCostModel, DecodeCostModel]:
        """The conductor's models. With the link model on and no ``bandwidth`` override,
        its transfer estimate assumes an idle NIC (``nic_bandwidth``) and storage link
        (``storage_bandwidth``): it does not see contention."""
        p = self.prefill_model or PrefillCostModel()
        t = self.transfer_model or TransferCostModel()
        net = self.bandwidth if self.bandwidth is not None else self.nic_bandwidth
        ssd = self.storage_bandwidth
        if net is not None or ssd is not None or self.layout is not None:
            t = TransferCostModel(
                bytes_per_token=t.bytes_per_token if self.layout is None else bytes_per_token(self.layout),
                network_bandwidth=net if net is not None else t.network_bandwidth,
                ssd_bandwidth=ssd if ssd is not None else t.ssd_bandwidth,
                latency_s=t.latency_s,
            )
        d = self.decode_model or DecodeCostModel()
        return p, t, d

    def conductor_config(self, policy: str | None = None, rejection: str | None = None) -> ConductorConfig:
        p, t, d = self.models()
        return ConductorConfig(
            block_size=self.block_tokens,
            ttft_slo_s=self.ttft_slo_s,
            tbt_slo_s=self.tbt_slo_s,
            policy=policy or self.policy,
            balancing_threshold=self.balancing_threshold,
            rejection=rejection or self.rejection,
            seed=self.seed,
            prefill_model=p,
            transfer_model=t,
            decode_model=d,
            # the conductor sees contention where the simulated cluster has it
            contention_aware=self.links and self.contention_aware,
            hot_replica_max_bytes=self.hot_replica_max_bytes,
            prefetch_staging_bytes=float(self.prefetch_staging_bytes),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (cost models as their coefficients)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k.endswith("_model"):
                continue
            if k in _NEW_FIELDS and v == _NEW_FIELDS[k]:
                continue  # off: the report reads as it did before these options existed
            if k == "role_policy":
                out[k] = v.to_dict()
                continue
            out[k] = describe(v) if k == "layout" else v
        p, t, d = self.models()
        out["prefill_model"] = {"c0": p.c0, "c_new": p.c_new, "c_new2": p.c_new2, "c_cross": p.c_cross}
        out["transfer_model"] = {
            "bytes_per_token": t.bytes_per_token,
            "network_bandwidth": t.network_bandwidth,
            "ssd_bandwidth": t.ssd_bandwidth,
            "latency_s": t.latency_s,
        }
        out["decode_model"] = {"base_s": d.base_s, "per_seq_s": d.per_seq_s, "per_token_s": d.per_token_s}
        tp, tt, td = self.true_models()
        if self.true_prefill_model is not None:
            out["true_prefill_model"] = {"c0": tp.c0, "c_new": tp.c_new, "c_new2": tp.c_new2, "c_cross": tp.c_cross}
        if self.true_transfer_model is not None:
            out["true_transfer_model"] = {
                "bytes_per_token": tt.bytes_per_token,
                "network_bandwidth": tt.network_bandwidth,
                "ssd_bandwidth": tt.ssd_bandwidth,
                "latency_s": tt.latency_s,
            }
        if self.true_decode_model is not None:
            out["true_decode_model"] = {"base_s": td.base_s, "per_seq_s": td.per_seq_s, "per_token_s": td.per_token_s}
        return out


#: fields added after the report format was fixed, with their "off" values: left out of
#: ``to_dict`` while off, so existing reports stay byte-identical
_NEW_FIELDS: dict[str, Any] = {
    "estimate_error": 0.0,
    "nic_bandwidth": None,
    "storage_bandwidth": None,
    "ssd_capacity_tokens_per_instance": None,
    "multipath": False,
    "layout": None,
    "adaptive_roles": False,
    "role_policy": None,
    "contention_aware": CONDUCTOR_DEFAULTS.contention_aware,
    "link_report_every_s": 0.2,
    "abandon_late_fetches": True,
    "hot_replica_max_bytes": CONDUCTOR_DEFAULTS.hot_replica_max_bytes,
    "prefetch_staging_bytes": CONDUCTOR_DEFAULTS.prefetch_staging_bytes,
}
