"""A stand-in external engine: our OpenAI front on an embedded Cluster that publishes its
prefix cache as KV events in vLLM's wire format (ZMQ PUB + replay ROUTER), so the whole
``serve --upstream`` path (events -> index -> routing -> proxy) runs without vLLM.

What it publishes is the engine-side view of a prefix cache: each prompt's full blocks
are kept in an LRU of ``capacity_blocks`` blocks, keyed by the engine's own chained hash
(BLAKE2b over the parent hash and the block's u32 tokens: opaque to us, as vLLM's are).
A prompt's blocks not yet cached are one ``BlockStored`` (with ``parent_block_hash`` and
``token_ids``); LRU overflow, :meth:`StandIn.evict` and :meth:`StandIn.clear` publish
``BlockRemoved`` / ``AllBlocksCleared``. ``form`` picks the positional or map payload,
``bytes_hashes`` 16-byte hashes instead of u64 ints. Used by the tests only (test_interop_upstream*.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mooncake_rs.kv_events.encode import Form
from mooncake_rs.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from mooncake_rs.kv_events.publisher import EventPublisher

__all__ = ["StandIn"]

class _PrefixCache:
    """The engine-side LRU of blocks; returns the events each change makes."""

    def __init__(self, block_size: int, capacity_blocks: int, bytes_hashes: bool) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.bytes_hashes = bytes_hashes
        self.blocks: OrderedDict[int | bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # submit runs on the server loop, evict on the caller's thread

    def _hash(self, parent: int | bytes | None, tokens: Sequence[int]) -> int | bytes:
        h = hashlib.blake2b(digest_size=16)
        if parent is not None:
            h.update(parent if isinstance(parent, bytes) else parent.to_bytes(8, "little"))
        h.update(array("I", tokens).tobytes())
        d = h.digest()
        return d if self.bytes_hashes else int.from_bytes(d[:8], "little")

    def chain(self, tokens: Sequence[int]) -> list[int | bytes]:
        bs, out, parent = self.block_size, [], None
        for i in range(len(tokens) // bs):
            parent = self._hash(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def store(self, tokens: Sequence[int]) -> list[KVEvent]:
        hashes = self.chain(tokens)
        with self._lock:
            first_new = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
            for h in hashes:
                self.blocks[h] = None
                self.blocks.move_to_end(h)
            events: list[KVEvent] = []
            if first_new < len(hashes):
                bs = self.block_size
                events.append(BlockStored(block_hashes=hashes[first_new:],
                                          parent_block_hash=hashes[first_new - 1] if first_new else None,
                                          token_ids=list(tokens[first_new * bs:len(hashes) * bs]), block_size=bs))
            gone = []
            while len(self.blocks) > self.capacity:
                gone.append(self.blocks.popitem(last=False)[0])
            if gone:
                events.append(BlockRemoved(block_hashes=gone))
        return events

    def evict(self, tokens: Sequence[int] | None) -> list[KVEvent]:
        with self._lock:
            gone = list(self.blocks) if tokens is None else [h for h in self.chain(tokens) if h in self.blocks]
            for h in gone:
                del self.blocks[h]
        return [BlockRemoved(block_hashes=gone)] if gone else []


class _PublishingCluster:
    """A Cluster whose ``submit`` also records the prompt in the prefix cache."""

    def __init__(self, cluster: Any, cache: _PrefixCache, publisher: EventPublisher) -> None:
        self._cluster, self._cache, self._pub = cluster, cache, publisher
        self.submitted: list[list[int]] = []

    def submit(self, prompt: Sequence[int], *args: Any, **kw: Any) -> Any:
        handle = self._cluster.submit(prompt, *args, **kw)
        self.submitted.append(list(prompt))
        self._pub.publish(self._cache.store(prompt))
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cluster, name)


class StandIn:
    """An OpenAI-compatible engine on 127.0.0.1 that publishes vLLM-format KV events.

    ``url`` (HTTP), ``events`` / ``replay`` (ZMQ endpoints), ``spec(name)`` the
    ``--upstream`` string. :meth:`hold` / :meth:`release` make its ``/v1/*`` requests wait
    (an engine busy with others), :meth:`evict` / :meth:`clear` drop cached blocks.
    """

    def __init__(self, model_dir: str | Path, *, block_size: int = 16, capacity_blocks: int = 1024,
                 form: Form = "positional", bytes_hashes: bool = False, model_name: str | None = None,
                 **cluster_kw: Any) -> None:
        from mooncake_rs.http import Frontend
        from mooncake_rs.http.app import create_app
        from mooncake_rs.http.server import ServerThread
        from mooncake_rs.serving import Cluster

        self.publisher = EventPublisher(form=form)
        self.cache = _PrefixCache(block_size, capacity_blocks, bytes_hashes)
        self._gate = threading.Event()
        self._gate.set()
        self.waiting = 0
        self.cluster = Cluster(str(model_dir), **{"prefill": 1, "decode": 1, "block_size": block_size, **cluster_kw})
        try:
            self.wrapped = _PublishingCluster(self.cluster, self.cache, self.publisher)
            self.front = Frontend.from_model_dir(self.wrapped, model_dir, model_name=model_name)
            self.server = ServerThread(self.front, app=self._gated(create_app(self.front))).start()
        except BaseException:
            self.close()
            raise

    def _gated(self, app: Any) -> Any:
        async def gated(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._gate.is_set():
                self.waiting += 1
                try:
                    while not self._gate.is_set():
                        await asyncio.sleep(0.01)
                finally:
                    self.waiting -= 1
            await app(scope, receive, send)
        return gated

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def events(self) -> str:
        return self.publisher.endpoint

    @property
    def replay(self) -> str:
        return self.publisher.replay_endpoint

    def spec(self, name: str) -> str:
        return f"{name}={self.url},events={self.events},replay={self.replay}"

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def evict(self, tokens: Sequence[int] | None = None) -> None:
        """Drop the cached blocks of ``tokens`` (None: all) and publish ``BlockRemoved``."""
        self.publisher.publish(self.cache.evict(tokens))

    def clear(self) -> None:
        with self.cache._lock:
            self.cache.blocks.clear()
        self.publisher.publish([AllBlocksCleared()])

    def close(self) -> None:
        self.release()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
        self.cluster.close()
        self.publisher.close()

    def __enter__(self) -> "StandIn":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
