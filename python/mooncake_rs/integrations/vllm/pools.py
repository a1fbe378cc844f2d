"""The local pool's events for the blocks this instance saved, as vLLM KV events
(``BlockStored`` / ``BlockRemoved`` with medium ``CPU``, vLLM's own block hashes), for
``take_events``: vLLM publishes them with its own, so a KV-event consumer (our conductor,
an indexer) sees what the pool holds for this instance."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["VllmPoolEvents", "MEDIUM"]

MEDIUM = "CPU"  # how vLLM's events name an offload tier in host memory


#: how long a planned save is waited for in the pool's events (a save skipped because the
#: pool held the block or was full never shows up)
EXPECT_S = 10.0


class VllmPoolEvents:
    def __init__(self) -> None:
        self._expected: dict[int, dict[str, Any]] = {}  # key -> vLLM event fields (blocks we save)
        self._published: dict[int, Any] = {}  # key -> vLLM hash announced as stored
        self._out: list[Any] = []

    def expect(self, key: int, fields: dict[str, Any] | None) -> None:
        if fields is not None:
            self._expected[key] = {**fields, "at": time.monotonic()}

    @property
    def pending(self) -> bool:
        """Saves were planned whose stored events have not come yet (then the caller polls
        the pool at once: the step that committed them has just ended)."""
        if self._expected:
            cut = time.monotonic() - EXPECT_S
            for k in [k for k, f in self._expected.items() if f["at"] < cut]:
                del self._expected[k]
        return bool(self._expected)

    def on_local_events(self, stored: list[int], gone: list[int]) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for k in stored:
            f = self._expected.pop(k, None)
            if f is None:
                continue
            lora = f["lora"]
            h = maybe_convert_block_hash(f["hash"])
            self._published[k] = h
            self._out.append(BlockStored(
                block_hashes=[h], parent_block_hash=maybe_convert_block_hash(f["parent"]) if f["parent"] else None,
                token_ids=list(f["tokens"]), block_size=len(f["tokens"]),
                lora_id=lora.adapter_id if lora else None, medium=MEDIUM, lora_name=lora.name if lora else None))
        removed = [self._published.pop(k) for k in gone if k in self._published]
        if removed:
            self._out.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out
