"""Simulator configuration (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._core import ConductorConfig, DecodeCostModel, PrefillCostModel, TransferCostModel
from ..errors import InvalidArgument
from .trace import BLOCK_TOKENS

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
    policy: str = "mooncake"
    rejection: str = "none"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    bandwidth: float | None = None
    prefill_model: PrefillCostModel | None = None
    transfer_model: TransferCostModel | None = None
    decode_model: DecodeCostModel | None = None
    speedup: float = 1.0
    seed: int = 0
    block_tokens: int = BLOCK_TOKENS
    balancing_threshold: float = 2.0
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
        for name, cls in (
            ("prefill_model", PrefillCostModel),
            ("transfer_model", TransferCostModel),
            ("decode_model", DecodeCostModel),
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

    def models(self) -> tuple[PrefillCostModel, TransferCostModel, DecodeCostModel]:
        p = self.prefill_model or PrefillCostModel()
        t = self.transfer_model or TransferCostModel()
        if self.bandwidth is not None:
            t = TransferCostModel(
                bytes_per_token=t.bytes_per_token,
                network_bandwidth=self.bandwidth,
                ssd_bandwidth=t.ssd_bandwidth,
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
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (cost models as their coefficients)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k.endswith("_model"):
                continue
            out[k] = v
        p, t, d = self.models()
        out["prefill_model"] = {"c0": p.c0, "c_new": p.c_new, "c_new2": p.c_new2, "c_cross": p.c_cross}
        out["transfer_model"] = {
            "bytes_per_token": t.bytes_per_token,
            "network_bandwidth": t.network_bandwidth,
            "ssd_bandwidth": t.ssd_bandwidth,
            "latency_s": t.latency_s,
        }
        out["decode_model"] = {"base_s": d.base_s, "per_seq_s": d.per_seq_s, "per_token_s": d.per_token_s}
        return out
