"""Disaggregated serving: prefill and decode instances, layer-wise KV streaming, the
``Cluster`` API (see docs/serving.md). Imports torch (through the engine)."""

from __future__ import annotations

from .cluster import Cluster
from .config import ServingConfig
from ..client.handle import RequestHandle
from ..base.metrics import RequestMetrics
from .metrics import ClusterMetrics

__all__ = ["Cluster", "ServingConfig", "RequestHandle", "RequestMetrics", "ClusterMetrics"]
