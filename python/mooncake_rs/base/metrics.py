"""What one request cost and where it ran: ``RequestOutput.metrics``, filled by the
cluster's router and carried to remote clients."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RequestMetrics"]


@dataclass
class RequestMetrics:
    """What one request cost and where it ran (``RequestOutput.metrics``).

    ``reused_tokens``: prompt tokens whose KV came from a store (this instance's or
    fetched); ``fetched_tokens``: the part fetched from another instance;
    ``computed_tokens``: prompt tokens prefilled here; ``transferred_bytes``: KV bytes
    moved for it (prefix fetch + prefill -> decode). ``kv_ready_s``: from prefill start to
    the decode instance having every block. ``fetch_sources``: the holders its prefix
    fetch read from at once (0: no fetch; 2 or more: a multi-source fetch,
    ``Cluster(multipath=True)``); ``fetch_s``: how long that fetch took, at the prefill
    instance (0: no fetch).
    """

    ttft_s: float = math.nan
    tbt_s: float = 0.0
    reused_tokens: int = 0
    fetched_tokens: int = 0
    computed_tokens: int = 0
    transferred_bytes: int = 0
    prefill_instance: int = -1
    decode_instance: int = -1
    kv_ready_s: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    fetch_sources: int = 0
    fetch_s: float = 0.0
    token_intervals: list[float] = field(default_factory=list, repr=False)
