"""Trace replay and cluster simulation against the real conductor and eviction code.

``import mooncake_rs.sim`` needs neither torch nor matplotlib (plots import it lazily).
"""

from __future__ import annotations

from .config import POLICIES, REJECTIONS, SimConfig
from .curves import hit_rate_curve
from .layouts import MLALayout
from .phased import SHIFTING_PHASES, Phase, phased_trace
from .report import HotSample, Report, RequestResult
from .roles import RolePolicy, RoleSwitch
from .simulator import Simulator
from .trace import BLOCK_TOKENS, Request, generate_trace, load_trace, save_trace, trace_stats

__all__ = [
    "BLOCK_TOKENS",
    "POLICIES",
    "REJECTIONS",
    "SHIFTING_PHASES",
    "HotSample",
    "MLALayout",
    "Phase",
    "Report",
    "Request",
    "RequestResult",
    "RolePolicy",
    "RoleSwitch",
    "SimConfig",
    "Simulator",
    "generate_trace",
    "hit_rate_curve",
    "load_trace",
    "phased_trace",
    "save_trace",
    "trace_stats",
]
