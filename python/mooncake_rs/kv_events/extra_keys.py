"""Per-block extra keys as vLLM publishes them, for hashing prompts the way the ingest
hashes vLLM's blocks.

vLLM folds request metadata into its block hashes (a LoRA adapter, a ``cache_salt``,
multimodal inputs, prompt embeddings), so two requests with the same tokens but, say,
different salts never share a cached block. Its ``BlockStored`` events carry those keys
as ``extra_keys``: one entry per block, ``None`` or a list of untagged values in this
order: the LoRA name (every block of a LoRA request), ``[identifier, offset]`` pairs of
multimodal inputs in the block, the cache salt (the first block only), a prompt-embeds
digest. The ingest folds each entry's msgpack bytes into our chain
(``PrefixHasher.hash(..., extras=...)``, :mod:`mooncake_rs.hash`); a query must pass the
same entries to hash its prompt to the same blocks: :func:`vllm_block_extras` builds
them for text prompts (a salt and/or an adapter).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import InvalidArgument

__all__ = ["vllm_block_extras", "encode_extra_keys"]

_encode = msgspec.msgpack.Encoder().encode


def encode_extra_keys(entry: Any) -> bytes | None:
    """One block's ``extra_keys`` entry (as decoded from an event) -> the bytes our hashers
    fold in: its msgpack encoding, or ``None`` for no entry."""
    return None if entry is None else _encode(entry)


def vllm_block_extras(n_blocks: int, *, cache_salt: str | None = None, lora_name: str | None = None) -> list[bytes | None]:
    """The ``extras`` of a text prompt's ``n_blocks`` full blocks, as vLLM publishes them
    for a request with this ``cache_salt`` and LoRA adapter ``lora_name``: block 0
    ``[lora_name?, cache_salt?]``, later blocks ``[lora_name]`` or none. Empty strings
    count as unset (vLLM adds neither then)."""
    if n_blocks < 0:
        raise InvalidArgument(f"n_blocks must be >= 0, got {n_blocks}")
    for name, v in (("cache_salt", cache_salt), ("lora_name", lora_name)):
        if v is not None and not isinstance(v, str):
            raise InvalidArgument(f"{name} must be a str or None, got {type(v).__name__}")
    lora = [lora_name] if lora_name else []
    out: list[bytes | None] = []
    for i in range(n_blocks):
        keys = lora + ([cache_salt] if i == 0 and cache_salt else [])
        out.append(encode_extra_keys(keys) if keys else None)
    return out
