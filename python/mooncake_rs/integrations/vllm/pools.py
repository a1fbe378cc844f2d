"""The local pool's events for the blocks this instance saved, as vLLM KV events
(``BlockStored`` / ``BlockRemoved`` with medium ``CPU``, vLLM's own block hashes), for
``take_events``: vLLM publishes them with its own, so a KV-event consumer (our conductor,
an indexer) sees what the pool holds for this instance."""

from __future__ import annotations

from typing import Any

__all__ = ["VllmPoolEvents", "MEDIUM"]

MEDIUM = "CPU"  # how vLLM's events name an offload tier in host memory


class VllmPoolEvents:
    def __init__(self) -> None:
        self._expected: dict[int, dict[str, Any]] = {}  # key -> vLLM event fields (blocks we save)
        self._published: dict[int, Any] = {}  # key -> vLLM hash announced as stored
        self._out: list[Any] = []

    def expect(self, key: int, fields: dict[str, Any] | None) -> None:
        if fields is not None:
            self._expected[key] = fields

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
