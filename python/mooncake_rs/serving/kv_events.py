"""KV events out: a prefill instance's store events in the vLLM/SGLang ZMQ wire format.

Other indexers (Dynamo, llm-d, Mooncake's) and our own ``kv_events.KVEventSubscriber``
index an engine by its published ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events. This module turns the store's drained events
(``StoreEvents``: kind, key, tier; no tokens) into those events:

- ``stored`` / ``promoted`` (dram) -> ``BlockStored`` medium ``"CPU"``; ``demoted`` (the
  block reached the SSD tier) -> ``BlockStored`` medium ``"DISK"``;
- ``evicted`` / ``removed`` -> ``BlockRemoved`` of that tier's medium.

The engine hash we publish is our own 128-bit prefix hash as 16 big-endian bytes (the wire
format allows bytes hashes; a u64 int could not hold it). ``BlockStored`` must carry the
block's ``token_ids`` and its parent's hash so a subscriber can recompute its own hashes:
the prefill role tells us (:meth:`KVEventsOut.learn`) the keys and prompt of every request
it takes, and we keep ``key -> (parent key, tokens)`` in a bounded LRU map. A block whose
tokens were forgotten (more distinct blocks than ``capacity`` since) is not published as
stored (counted in ``untracked``): a subscriber then under-reports, never over-reports.

Runs on the instance's loop thread (learn and convert), so the map needs no lock; the
sockets live on the publisher's own thread (``kv_events.publisher.EventPublisher``, which
also answers replay requests on its ROUTER).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._core import BlockHashes, StoreEvents
from ..errors import InvalidArgument

if TYPE_CHECKING:  # the kv_events package is imported when an instance publishes, not before
    from ..kv_events.events import KVEvent

__all__ = ["KVEventsOut", "endpoints_for", "MEDIUM_OF_TIER"]

MEDIUM_OF_TIER = {"dram": "CPU", "ssd": "DISK"}
"""The medium named in the events for each store tier."""

#: blocks whose tokens are remembered when no store size is given
DEFAULT_CAPACITY = 1 << 16


def _wire_hash(key: int) -> bytes:
    return key.to_bytes(16, "big")


def _parse_tcp(endpoint: str) -> tuple[str, int]:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise InvalidArgument(f"kv_events endpoints are tcp://HOST:PORT, got {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not host or not 0 < p < 65536:
        raise InvalidArgument(f"kv_events endpoint {endpoint!r} needs a host and a port in 1..65535 "
                              "(fixed ports: subscribers must know where to connect)")
    return host, p


def endpoints_for(kv_events: Any, prefill_names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Where each prefill instance publishes: ``name -> (PUB endpoint, replay ROUTER endpoint)``.

    ``kv_events`` is ``"tcp://HOST:PORT"`` (the i-th prefill instance binds PORT + 2i, its
    replay PORT + 2i + 1) or a dict ``{instance name: "tcp://HOST:PORT"}`` (replay on
    PORT + 1; instances not named publish nothing). Raises :class:`InvalidArgument`.
    """
    if kv_events is None:
        return {}
    out: dict[str, tuple[str, str]] = {}
    if isinstance(kv_events, str):
        host, port = _parse_tcp(kv_events)
        if port + 2 * len(prefill_names) > 65536:
            raise InvalidArgument(f"kv_events {kv_events!r}: ports PORT..PORT+{2 * len(prefill_names) - 1} "
                                  "must all be below 65536")
        for i, name in enumerate(prefill_names):
            out[name] = (f"tcp://{host}:{port + 2 * i}", f"tcp://{host}:{port + 2 * i + 1}")
        return out
    if isinstance(kv_events, dict):
        for name, ep in kv_events.items():
            if name not in prefill_names:
                raise InvalidArgument(f"kv_events names {name!r}, which is no prefill instance "
                                      f"(they are {', '.join(prefill_names)})")
            host, port = _parse_tcp(ep)
            if port >= 65535:
                raise InvalidArgument(f"kv_events endpoint {ep!r}: its replay port PORT + 1 must be below 65536")
            out[name] = (ep, f"tcp://{host}:{port + 1}")
        return out
    raise InvalidArgument(f"kv_events is a 'tcp://HOST:PORT' string or a dict of instance name -> endpoint, "
                          f"got {type(kv_events).__name__}")


class KVEventsOut:
    """One prefill instance's event publisher (PUB on ``endpoint``, replay on ``replay_endpoint``)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int, *,
                 capacity: int = DEFAULT_CAPACITY, keep: int = 10_000) -> None:
        from ..kv_events.publisher import EventPublisher

        if capacity < 1:
            raise InvalidArgument(f"KVEventsOut capacity must be >= 1, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        # our key -> (parent key or None, the block's tokens as u32 bytes); LRU order
        self._blocks: OrderedDict[int, tuple[int | None, bytes]] = OrderedDict()
        self.untracked = 0
        """Stored blocks not published because their tokens were no longer known."""
        self.published = 0
        """Events handed to the publisher."""
        try:
            self._pub = EventPublisher(form="positional", keep=keep, endpoint=endpoint,
                                       replay_endpoint=replay_endpoint)
        except RuntimeError as e:  # the port is taken, or the host is not this machine's
            raise InvalidArgument(f"cannot publish KV events on {endpoint} (replay {replay_endpoint}): {e}; "
                                  "pick free ports in kv_events") from None
        self.endpoint = endpoint
        self.replay_endpoint: str = self._pub.replay_endpoint  # None: a random port on 127.0.0.1

    @staticmethod
    def capacity_for(store_slots: int) -> int:
        """The token map's size for a store of ``store_slots`` (DRAM + SSD) slots: twice
        that (prompts name blocks the store never keeps), at least 4096."""
        return max(4096, 2 * store_slots)

    def learn(self, keys: bytes | BlockHashes, prompt: Sequence[int]) -> None:
        """Remember the tokens of each full block of ``prompt`` (``keys``: their hashes)."""
        bs, blocks = self.block_size, self._blocks
        parent: int | None = None
        for i, k in enumerate(BlockHashes(keys) if isinstance(keys, bytes) else keys):
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = (parent, array("I", prompt[i * bs:(i + 1) * bs]).tobytes())
            parent = k
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def on_store_events(self, data: bytes) -> None:
        """Publish one drained batch (``StoreSlots.drain_events()`` bytes) as one event batch."""
        if not data:
            return
        from ..kv_events.events import BlockRemoved, BlockStored

        out: list[KVEvent] = []
        # a run of stored blocks of one chain (each the parent of the next, one medium)
        # goes out as one BlockStored, as engines publish a request's new blocks
        run: list[int] = []
        run_parent: int | None = None
        run_tokens = array("I")
        run_medium = ""

        def end_run() -> None:
            if run:
                out.append(BlockStored(block_hashes=[_wire_hash(k) for k in run],
                                       parent_block_hash=None if run_parent is None else _wire_hash(run_parent),
                                       token_ids=run_tokens.tolist(), block_size=self.block_size,
                                       medium=run_medium))
                run.clear()
                del run_tokens[:]

        for ev in StoreEvents.from_bytes(data):
            kind, key, medium = ev.kind, ev.key, MEDIUM_OF_TIER.get(ev.tier, ev.tier.upper())
            if kind in ("stored", "promoted", "demoted"):
                known = self._blocks.get(key)
                if known is None:
                    self.untracked += 1
                    continue
                parent, toks = known
                if not run or run[-1] != parent or run_medium != medium:
                    end_run()
                    run_parent, run_medium = parent, medium
                run.append(key)
                run_tokens.frombytes(toks)
            elif kind in ("evicted", "removed"):
                end_run()
                last = out[-1] if out else None
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.append(_wire_hash(key))  # one event per run of removals
                else:
                    out.append(BlockRemoved(block_hashes=[_wire_hash(key)], medium=medium))
        end_run()
        self._send(out)

    def _send(self, events: list[KVEvent]) -> None:
        if events:
            self.published += len(events)
            self._pub.publish(events)

    def close(self) -> None:
        """Tell subscribers this instance holds nothing any more, then stop the sockets."""
        from ..kv_events.events import AllBlocksCleared

        self._send([AllBlocksCleared()])
        time.sleep(0.05)  # let the PUB thread send it before the sockets close
        self._pub.close()
