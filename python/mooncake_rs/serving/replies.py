"""Replies to the cluster's own calls on its instances (``Stats``, ``Measure``,
``SwitchRole``), matched to their caller by query id.

Every such call carries a ``qid`` that no other call in flight has, and the instance
answers with the same ``qid`` (``StatsReply``, ``Timings``, ``RoleSwitched``, or
``Failed`` when the call raised). The router thread hands each reply to ``deliver``;
the caller waits on its own slot, so ``instance_stats``, ``calibrate`` and
``switch_role`` may run at the same time, from any threads, and never take each
other's answers. A reply nobody waits for any more (its caller timed out) is dropped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any, Callable

__all__ = ["Replies"]

log = logging.getLogger("mooncake_rs.serving")


class Replies:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._slots: dict[int, queue.SimpleQueue[tuple[int, Any]]] = {}

    def ask(self, send: Callable[[Any], None], make: Callable[[int], Any], timeout_s: float) -> tuple[int, Any] | None:
        """Sends ``make(qid)`` with a fresh query id through ``send`` and waits up to
        ``timeout_s`` for the reply of that id: ``(source, message)``, or None."""
        qid = self.open()
        try:
            send(make(qid))
            return self.wait(qid, timeout_s)
        finally:
            self.close(qid)

    def open(self) -> int:
        """A fresh query id, whose reply ``wait`` then returns."""
        qid = next(self._ids)
        with self._lock:
            self._slots[qid] = queue.SimpleQueue()
        return qid

    def wait(self, qid: int, timeout_s: float) -> tuple[int, Any] | None:
        with self._lock:
            slot = self._slots.get(qid)
        if slot is None:
            raise KeyError(f"query {qid} is not open")
        try:
            return slot.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def close(self, qid: int) -> None:
        """Forgets ``qid``: a reply that comes later is dropped."""
        with self._lock:
            self._slots.pop(qid, None)

    def deliver(self, src: int, msg: Any) -> None:
        """The router thread: a reply from instance ``src``, to its caller if it still waits."""
        with self._lock:
            slot = self._slots.get(msg.qid)
        if slot is None:
            log.debug("a %s from instance %d answers query %d, which nobody waits for", type(msg).__name__, src,
                      msg.qid)
            return
        slot.put((src, msg))
