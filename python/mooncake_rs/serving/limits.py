"""What a request must fit to be served, checked at ``Cluster.submit``.

Every instance would refuse such a prompt later (its engine checks the vocabulary, the
model's context and its KV page pool; its store has a fixed number of slots), but by
then the request has been scheduled and fails on an instance with an untyped message.
Checking here refuses it with ``InvalidArgument`` before the conductor sees it. The
capacities come from the instances' ``Ready`` messages (the smallest of each), and so do
the vocabulary and the context where no model config is given (a conductor service
across hosts has none of its own).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidArgument

__all__ = ["Limits"]


class Limits:
    def __init__(self, model_config: Any | None, block_size: int) -> None:
        self.block_size = block_size
        # 0: not known yet (no model config: learned from the instances)
        self.vocab_size = int(model_config.vocab_size) if model_config is not None else 0
        self.max_positions = int(model_config.max_position_embeddings) if model_config is not None else 0
        self.kv_tokens = 0  # tokens of KV an engine's page pool holds (0: not known yet)
        self.store_slots = 0  # blocks an instance's store holds at once

    def learn(self, ready: Sequence[Any]) -> None:
        """Takes the smallest capacities the instances reported (``protocol.Ready``:
        ``kv_tokens``, ``slots``, and ``vocab_size`` / ``max_positions`` when they say)."""
        if not ready:
            return
        self.kv_tokens = min(int(r.kv_tokens) for r in ready)
        self.store_slots = min(int(r.slots) for r in ready)
        vocab = [int(r.vocab_size) for r in ready if r.vocab_size]
        context = [int(r.max_positions) for r in ready if r.max_positions]
        if vocab:
            self.vocab_size = min(vocab)
        if context:
            self.max_positions = min(context)

    def check(self, toks: list[int], params: Any) -> None:
        """Raises ``InvalidArgument`` for a prompt (already a list of ints) that no
        instance could serve with ``params``."""
        lo, hi = min(toks), max(toks)
        if lo < 0 or (self.vocab_size and hi >= self.vocab_size):
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        if self.max_positions and len(toks) >= self.max_positions:
            raise InvalidArgument(f"prompt of {len(toks)} tokens reaches the model's context "
                                  f"(max_position_embeddings {self.max_positions})")
        if self.kv_tokens and len(toks) + params.max_tokens > self.kv_tokens:
            raise InvalidArgument(f"prompt ({len(toks)} tokens) + max_tokens ({params.max_tokens}) exceeds an "
                                  f"instance's KV pool of {self.kv_tokens} tokens; lower max_tokens or raise "
                                  "engine_kwargs['num_pages']")
        # the decode instance reserves a slot per prompt block at once (the prefill too)
        blocks = -(-len(toks) // self.block_size)
        if self.store_slots and blocks > self.store_slots:
            raise InvalidArgument(f"prompt of {len(toks)} tokens needs {blocks} store blocks at once, an instance's "
                                  f"store has {self.store_slots} slots; raise dram_bytes_per_instance")
