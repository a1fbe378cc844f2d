"""The simulator's entry point: :class:`Simulator` replays a trace on the cluster that a
:class:`SimConfig` describes, with the event loop of its ``architecture``: the
disaggregated cluster (:mod:`.disaggregated`) or the coupled baseline (:mod:`.coupled`).
Both derive from :class:`.loop.EventLoop`, which holds what they share.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._core import BlockCache, Conductor
from .adaptive import _AdaptiveRun
from .config import SimConfig
from .coupled import _Coupled
from .disaggregated import _Run
from .linked import _LinkedRun
from .links import Links
from .loop import EventLoop, Progress
from .report import Report
from .trace import Request

__all__ = ["Simulator"]

#: the event loop of each ``SimConfig.architecture``
_LOOPS: dict[str, type[EventLoop]] = {"disaggregated": _Run, "coupled": _Coupled}


class Simulator:
    """Replays a trace on the cluster that ``config`` describes."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        #: the conductor and the per-instance caches of the last run (for inspection)
        self.conductor: Conductor | None = None
        self.caches: list[BlockCache] | None = None
        #: with the SSD tier on, each prefill instance's SSD cache (None otherwise)
        self.ssd_caches: list[BlockCache | None] | None = None
        #: with the link model on, the run's links (instance k: NIC out 3k, in 3k+1,
        #: storage 3k+2), for inspection (None otherwise)
        self.links: Links | None = None

    def run(self, trace: Sequence[Request], progress: Progress | None = None) -> Report:
        """Replays ``trace``; ``progress(done, total)`` is called as arrivals go by."""
        cls = _LinkedRun if self.config.links else _LOOPS[self.config.architecture]
        if self.config.adaptive_roles:
            cls = _AdaptiveRun
        loop = cls(self.config, trace, progress)
        self.conductor, self.caches = loop.conductor, loop.caches
        self.ssd_caches = loop.ssd if isinstance(loop, _LinkedRun) else None
        self.links = loop.net if isinstance(loop, _LinkedRun) else None
        return loop.go()
