"""A pool client's links to the store nodes etcd lists: one pipelined connection per node
(links.py), opened when first needed and shared by every thread, and a node that could
not be asked is left alone for a moment (``DOWN_S``) so a batch does not wait on it
again and again."""

from __future__ import annotations

import threading
import time
from typing import Any

from .._core import TransferEngine
from .links import NodeDown, NodeLink, Pending
from .members import NodeDirectory

__all__ = ["NodeLinks", "DOWN_S"]

#: how long a node that could not be asked is skipped
DOWN_S = 1.0


class NodeLinks:
    def __init__(self, directory: NodeDirectory, token: str | None, te: TransferEngine,
                 io_timeout_s: float, spin_s: float = 0.0) -> None:
        """``spin_s``: how long a link's reader polls for an answer before it sleeps (links.py)."""
        self.directory = directory
        self.token = token
        self.te = te
        self.io_timeout_s = io_timeout_s
        self.spin_s = spin_s
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self.links: dict[str, NodeLink] = {}
        self._down: dict[str, float] = {}

    def live(self) -> list[str]:
        names = self.directory.names()
        if not self._down:
            return names
        now = time.monotonic()
        with self._lock:  # forget the pauses that ended (an empty table is the fast path)
            self._down = {n: t for n, t in self._down.items() if t > now}
        return [n for n in names if self._down.get(n, 0.0) <= now]

    def link(self, node: str) -> NodeLink:
        link = self.links.get(node)  # (one dict read is atomic: no lock on a small call's path)
        if link is not None and not link.broken:
            return link
        with self._connecting:  # one connection per node: threads that need it together share it
            with self._lock:
                link = self.links.get(node)
                if link is not None and not link.broken:
                    return link
            rec = self.directory.nodes().get(node)
            if rec is None:
                raise NodeDown(f"store node {node} left")
            try:
                link = NodeLink(rec, self.token, self.te, self.io_timeout_s, spin_s=self.spin_s)
            except NodeDown:
                self.mark_down(node)
                raise
            with self._lock:
                self.links[node] = link
            return link

    def mark_down(self, node: str) -> None:
        with self._lock:
            self._down[node] = time.monotonic() + DOWN_S
            link = self.links.pop(node, None)
        if link is not None:
            link.close()

    def call(self, node: str, make: type, **fields: object) -> Any:
        return self.result(node, self.submit(node, make, **fields))

    def submit(self, node: str, make: type, **fields: object) -> Pending:
        """Sends a request to ``node`` without waiting (the link is pipelined)."""
        try:
            return self.link(node).submit(make, **fields)
        except NodeDown:
            self.mark_down(node)
            raise

    def result(self, node: str, pending: Pending) -> Any:
        try:
            return pending.result()
        except NodeDown:
            self.mark_down(node)
            raise

    def asked(self, node: str, make: type, **fields: object) -> Pending | NodeDown:
        """``submit``, with a node that cannot be asked as a value (batches ask many)."""
        try:
            return self.submit(node, make, **fields)
        except NodeDown as e:
            return e

    def answer(self, node: str, asked: Pending | NodeDown) -> Any:
        if isinstance(asked, NodeDown):
            raise asked
        return self.result(node, asked)

    def ask_one(self, node: str, make: type, **fields: object) -> Any:
        """One request and its answer; None when the node could not answer. A direct
        call on the link: no pending answer to keep (what a small-key call to a one-node
        pool pays for)."""
        try:
            link = self.link(node)
        except NodeDown:
            return None
        try:
            return link.call(make, **fields)
        except NodeDown:
            self.mark_down(node)
            return None

    def ask_each(self, asks: list[tuple[str, type, dict[str, Any]]]) -> list[Any]:
        """Each ``(node, request type, fields)`` sent before any answer is read (their round
        trips overlap); the answers in order, None for a node that could not answer."""
        if len(asks) == 1:  # nothing to overlap
            node, make, fields = asks[0]
            return [self.ask_one(node, make, **fields)]
        sent = [(node, self.asked(node, make, **fields)) for node, make, fields in asks]
        out = []
        for node, asked in sent:
            try:
                out.append(self.answer(node, asked))
            except NodeDown:
                out.append(None)
        return out

    def close(self) -> None:
        with self._lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.close()
