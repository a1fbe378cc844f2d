"""What a request must fit to be served, checked at ``Cluster.submit``.

Every instance would refuse such a prompt later (its engine checks the vocabulary, the
model's context and its KV page pool; its store has a fixed number of slots), but by
then the request has been scheduled and fails on an instance with an untyped message.
Checking here refuses it with ``InvalidArgument`` before the conductor sees it. The
capacities come from the instances' ``Ready`` messages (the smallest of each).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidArgument

__all__ = ["Limits"]


class Limits:
    def __init__(self, model_config: Any, block_size: int) -> None:
        self.cfg = model_config
        self.block_size = block_size
        self.kv_tokens = 0  # tokens of KV an engine's page pool holds (0: not known yet)
        self.store_slots = 0  # blocks an instance's store holds at once

    def learn(self, ready: Sequence[Any]) -> None:
        """Takes the smallest capacities the instances reported when they started
        (``protocol.Ready``: ``kv_tokens``, ``slots``)."""
        self.kv_tokens = min(int(r.kv_tokens) for r in ready)
        self.store_slots = min(int(r.slots) for r in ready)

    def check(self, toks: list[int], params: Any) -> None:
        """Raises ``InvalidArgument`` for a prompt (already a list of ints) that no
        instance could serve with ``params``."""
        cfg = self.cfg
        lo, hi = min(toks), max(toks)
        if lo < 0 or hi >= cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"token id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1}")
        if len(toks) >= cfg.max_position_embeddings:
            raise InvalidArgument(f"prompt of {len(toks)} tokens reaches the model's context "
                                  f"(max_position_embeddings {cfg.max_position_embeddings})")
        if self.kv_tokens and len(toks) + params.max_tokens > self.kv_tokens:
            raise InvalidArgument(f"prompt ({len(toks)} tokens) + max_tokens ({params.max_tokens}) exceeds an "
                                  f"instance's KV pool of {self.kv_tokens} tokens; lower max_tokens or raise "
                                  "engine_kwargs['num_pages']")
        # the decode instance reserves a slot per prompt block at once (the prefill too)
        blocks = -(-len(toks) // self.block_size)
        if self.store_slots and blocks > self.store_slots:
            raise InvalidArgument(f"prompt of {len(toks)} tokens needs {blocks} store blocks at once, an instance's "
                                  f"store has {self.store_slots} slots; raise dram_bytes_per_instance")
