"""Questions about keys asked of each key's nodes in rendezvous rank order (placement.py):
one rank a round, every node of a round asked at once, a key passed to its next node
only when its node could not answer or did not have it; so a lookup costs one round
trip per node and batch while every replica is up."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .node_links import NodeLinks
from .placement import rank_nodes

__all__ = ["RankedAsks"]


class RankedAsks:
    def __init__(self, nodes: NodeLinks) -> None:
        self.nodes = nodes

    def values(self, keys: list[str], make: type, found: Callable[[int], bool]) -> list[int]:
        """Asks each key's nodes in rank order until ``found(value)``; the last answer (0
        for a key no node could answer about)."""
        live = self.nodes.live()
        if len(live) == 1:  # one node, one request: its answer is the list (no per-key Python)
            rep = self.nodes.ask_one(live[0], make, keys=keys)
            vals = rep.values if rep is not None else []
            return vals if len(vals) == len(keys) else (list(vals) + [0] * len(keys))[:len(keys)]
        out = [0] * len(keys)

        def take(idx: list[int], rep: Any) -> list[int]:
            if rep is None:
                return idx
            for i, v in zip(idx, rep.values):
                out[i] = v
            return [i for i, v in zip(idx, rep.values) if not found(v)]

        self.by_rank(keys, lambda idx: (make, {"keys": [keys[i] for i in idx]}), take)
        return out

    def by_rank(self, keys: list[str], request: Callable[[list[int]], tuple[type, dict[str, Any]]],
                 take: Callable[[list[int], Any], list[int]]) -> None:
        """Each key's replica nodes in rank order, one rank a round, every node of a round
        asked at once: ``request(indices)`` is what a node is asked about those keys,
        ``take(indices, answer or None)`` handles its answer and returns the keys to ask of
        their next-ranked node; stops when none is left or every live node was asked."""
        live = self.nodes.live()
        todo = list(range(len(keys)))
        if len(live) == 1:  # one node holds every key there is: no ranking, one request
            make, fields = request(todo)
            take(todo, self.nodes.ask_one(live[0], make, **fields))
            return
        ranks = [rank_nodes(k, live) for k in keys]
        for rnd in range(len(live)):
            if not todo:
                break
            by_node: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                by_node[ranks[i][rnd]].append(i)
            groups = list(by_node.items())
            answers = self.nodes.ask_each([(node, *request(idx)) for node, idx in groups])
            todo = [i for (_, idx), rep in zip(groups, answers) for i in take(idx, rep)]

