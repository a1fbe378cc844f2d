"""The per-block extra keys vLLM folds into its block hashes, built for a request.

vLLM partitions its prefix cache by more than tokens: a LoRA adapter's name goes into
every block's hash, a request's ``cache_salt`` into its first block's, multimodal
identifiers into the blocks they cover. Its KV events publish them per block
(``extra_keys``: nil, or an array of those keys in that order), and our ingest folds
each block's entry (its msgpack bytes) into our chain. To hash a request's prompt the
same way, build the entries it would have: :func:`vllm_block_extras`.
"""

from __future__ import annotations

import msgspec

__all__ = ["vllm_block_extras"]

_encode = msgspec.msgpack.Encoder().encode


def vllm_block_extras(n_blocks: int, *, cache_salt: str | None = None,
                      lora_name: str | None = None) -> list[bytes | None]:
    """One entry per full block, as vLLM publishes them: ``[lora_name, cache_salt]`` for
    block 0 (each only if set), ``[lora_name]`` after it; ``None`` where there is nothing."""
    first = [k for k in (lora_name, cache_salt) if k]
    rest = _encode([lora_name]) if lora_name else None
    return [(_encode(first) if first else None) if i == 0 else rest for i in range(n_blocks)]
