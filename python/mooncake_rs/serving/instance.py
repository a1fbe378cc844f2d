"""One serving instance: an Engine, a Store (``StoreSlots``) and a TransferEngine
(``Transport``), driven by a loop that reads control messages, steps the engine and
reports back.

The same class runs inside the cluster's process (a thread per instance,
``processes=False``) and inside a worker process (``processes=True``, see worker.py).
Store events (stored/evicted blocks) go to the cluster, which feeds the conductor's
index; progress (prefill started/finished, decode started, tokens) feeds its load model.
The role-specific behaviour is in prefill.py and decode.py.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arena import StoreSlots
from .control import Msg
from .transport import Transport

__all__ = ["InstanceSpec", "Instance"]

log = logging.getLogger("mooncake_rs.serving")


@dataclass
class InstanceSpec:
    """What an instance is built from (picklable: sent to worker processes)."""

    id: int
    role: str  # "prefill" or "decode"
    name: str
    model: Any  # ModelConfig, preset name or model directory
    block_size: int
    dram_bytes: int
    seed: int = 0
    stream_layers: bool = True
    link_bandwidth: float | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the store's SSD tier (a directory of this instance's own), or None for DRAM only
    ssd_path: str | None = None
    ssd_bytes: int = 0
    #: seconds between heartbeats of a worker process (0: none; in-process instances send none)
    heartbeat_s: float = 0.0


class Instance:
    def __init__(self, spec: InstanceSpec, channel: Any, registry: Any = None,
                 auth_token: str | None = None) -> None:
        from ..engine import Engine
        from .decode import DecodeRole
        from .prefill import PrefillRole

        self.spec = spec
        self.ch = channel
        model = spec.model if not isinstance(spec.model, Path) else str(spec.model)
        self.engine = Engine(model, block_size=spec.block_size, seed=spec.seed, **spec.engine_kwargs)
        self.layout = self.engine.layout
        self.store = StoreSlots(self.layout.block_nbytes, spec.dram_bytes, shared_memory=registry is None,
                                ssd_path=spec.ssd_path, ssd_bytes=spec.ssd_bytes,
                                scope=spec.id)
        self.transport = Transport(spec.name, self.store.store, registry, spec.link_bandwidth,
                                   auth_token=auth_token, peers_write=spec.role == "decode")
        self.endpoint = self.transport.endpoint
        self.role = PrefillRole(self) if spec.role == "prefill" else DecodeRole(self)
        self._pins: dict[int, list[Any]] = {}
        self.stopped = False

    # ---- the loop
    def run(self) -> None:
        cache = self.engine.cache
        self.ch.send({"op": "ready", "arena": self.endpoint, "pid": os.getpid(), "block_bytes": self.layout.block_nbytes,
                      "slots": self.store.store.slots, "kv_tokens": cache.num_pages * cache.page_size})
        try:
            while not self.stopped:
                if self.engine.has_unfinished():
                    timeout: float | None = 0
                elif self.role.busy():
                    timeout = 0.001
                else:
                    timeout = 0.05
                msg = self.ch.recv(timeout)
                while msg is not None and not self.stopped:
                    self.handle(msg)
                    msg = self.ch.recv(0)
                if self.engine.has_unfinished():
                    self.role.on_outputs(self.engine.step())
                self.role.poll()
                self.flush_store_events()
        finally:
            self.transport.close()

    def handle(self, msg: Msg) -> None:
        op = msg["op"]
        try:
            if op == "stop" or op == "dead":
                self.stopped = True
            elif op == "export":
                self._export(msg)
            elif op == "unpin":
                for blk in self._pins.pop(msg["rid"], []):
                    blk.release()
            elif op == "stats":
                t = self.transport
                self.ch.send({"op": "measured", "stats": {"copied_bytes": t.total_bytes, "copy_busy_s": t.busy_s,
                                                          "blocks": len(self.store),
                                                          "evictions": self.store.evictions,
                                                          # what a finished or cancelled request must not leave behind
                                                          "requests": self.role.tracked(),
                                                          "pinned_requests": len(self._pins),
                                                          "free_pages": self.engine.num_free_pages,
                                                          "pages": self.engine.cache.num_pages}})
            elif op == "measure":
                timings = self.engine.measure_prefill(msg["points"], repeats=msg.get("repeats", 3))
                self.ch.send({"op": "measured", "timings": [(t.new_tokens, t.cached_tokens, t.seconds)
                                                            for t in timings]})
            else:
                self.role.handle(msg)
        except Exception as e:  # a bad request fails that request, not the instance
            log.exception("instance %s: %s failed", self.spec.name, op)
            self.ch.send({"op": "failed", "rid": msg.get("rid"), "error": f"{type(e).__name__}: {e}"})

    def _export(self, msg: Msg) -> None:
        """Pins the longest held prefix of ``keys`` and names its slots' offsets."""
        blocks = []
        for k in msg["keys"]:
            b = self.store.lookup(k)
            if b is None:
                break
            blocks.append(b)
        self._pins.setdefault(msg["rid"], []).extend(blocks)
        self.ch.send({"op": "exported", "rid": msg["rid"], "arena": self.endpoint,
                      "offsets": [self.store.offset(b) for b in blocks]})

    def flush_store_events(self) -> None:
        ev = self.store.drain_events()
        if ev and self.spec.role == "prefill":
            self.ch.send({"op": "store", "events": ev})

    @staticmethod
    def now() -> float:
        return time.monotonic()
