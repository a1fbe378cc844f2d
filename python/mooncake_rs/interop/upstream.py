"""Routing requests over external OpenAI-compatible engines ("upstreams") with our conductor.

Each upstream is a prefill instance of a :class:`~mooncake_rs.Conductor` (slot = its
position in the list); its KV events (vLLM's ZMQ wire format) are ingested into the
conductor's block index (:class:`.ingest.Ingestor` over :class:`.targets.TierTarget`),
so ``schedule`` sees which upstream holds how much of a prompt, and on which tier.

Load is what we proxy: a request joins its upstream's prefill queue when routed and
leaves it at its first token (``first_token``), so the conductor's queue estimate of an
upstream is the estimated prefill work of the requests it has not answered yet; an
estimate that does not decay with the clock while the engine has not answered. The
decode phase is accounted on one shared pseudo decode instance (an external engine
decodes where it prefilled; we have no decode model of it), so TBT admission is not
meaningful here and the default rejection is ``none``.

The default policy is ``local_cache_aware`` (queue + prefill after the local prefix):
external engines cannot fetch each other's blocks, so the policies that price a fetch
(``mooncake``, ``ttft_optimal``) would assume a transfer that never happens.

This file is transport-free (no HTTP): :mod:`.proxy` is the ASGI app over it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core import BlockHashes, Conductor, ConductorConfig, PrefixHasher
from ..errors import InvalidArgument
from ..kv_events.extra_keys import vllm_block_extras
from ..kv_events.ingest import Ingestor
from ..kv_events.targets import TierTarget

__all__ = ["UpstreamSpec", "parse_upstream", "UpstreamRouter", "Route", "DECODE_SLOT"]

log = logging.getLogger("mooncake_rs.interop")

DECODE_SLOT = 1 << 62
"""The id of the shared pseudo decode instance (never an upstream's slot)."""


@dataclass(frozen=True)
class UpstreamSpec:
    """One ``--upstream NAME=URL,events=ENDPOINT[,replay=ENDPOINT]``."""

    name: str
    url: str
    events: str | None = None
    replay: str | None = None


def parse_upstream(text: str) -> UpstreamSpec:
    """``NAME=http://host:port,events=tcp://host:5557[,replay=tcp://host:5558]``."""
    head, _, rest = text.partition(",")
    name, eq, url = head.partition("=")
    name, url = name.strip(), url.strip()
    if not eq or not name or not url:
        raise InvalidArgument(f"--upstream {text!r}: expected NAME=http://host:port,events=tcp://host:5557"
                              "[,replay=tcp://host:5558]")
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"--upstream {text!r}: the URL of {name!r} must start with http:// or https://")
    opts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq or k not in ("events", "replay") or not v:
            raise InvalidArgument(f"--upstream {text!r}: unknown option {part!r}; the options are "
                                  "events=tcp://HOST:PORT and replay=tcp://HOST:PORT")
        if k in opts:
            raise InvalidArgument(f"--upstream {text!r}: {k}= is given twice")
        opts[k] = v
    if "replay" in opts and "events" not in opts:
        raise InvalidArgument(f"--upstream {text!r}: replay= needs events= (the publisher it replays)")
    return UpstreamSpec(name, url.rstrip("/"), opts.get("events"), opts.get("replay"))


def _learn_block_size(upstreams: Sequence[UpstreamSpec]) -> int:
    """The block size every upstream reports (metrics, else replay buffer); they must agree."""
    from .engine_info import discover_block_size

    sizes = {u.name: discover_block_size(u.url, u.replay) for u in upstreams}
    known = {n: s for n, s in sizes.items() if s is not None}
    if not known:
        raise InvalidArgument(f"could not learn the KV block size of the upstreams {list(sizes)} (no "
                              "vllm:cache_config_info in their /metrics, nothing in their replay buffers): "
                              "pass --block-size, the engines' --block-size")
    if len(set(known.values())) > 1:
        raise InvalidArgument(f"the upstreams cache blocks of different sizes {known}: route engines of one "
                              "block size together")
    size = next(iter(known.values()))
    log.info("upstream KV block size %d (reported by %s)", size, ", ".join(known))
    return size


@dataclass
class _Upstream:
    spec: UpstreamSpec
    slot: int
    ingestor: Ingestor
    subscriber: Any = None
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    down_until: float | None = None
    """Unreachable: out of the conductor until then (``mark_down``)."""


@dataclass
class Route:
    """A routed request: where it goes and what the conductor decided."""

    request_id: int
    name: str
    url: str
    slot: int
    reused_blocks: int
    prompt_tokens: int
    _state: str = field(default="queued", repr=False)  # queued -> decoding (-> gone) -> done


class UpstreamRouter:
    """Picks an upstream per prompt (conductor + KV events) and tracks what is in flight.

    ``subscribe=False`` starts no ZMQ subscriber (tests feed ``ingestor(name)`` directly).
    ``clock``: seconds, monotonic (the conductor's ``now``).
    """

    def __init__(self, upstreams: Sequence[UpstreamSpec], *, block_size: int | None = None, seed: int = 0,
                 policy: str = "local_cache_aware", rejection: str = "none", ttft_slo_s: float = 30.0,
                 subscribe: bool = True, map_capacity: int = 1 << 20, down_cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, **conductor_kw: Any) -> None:
        if not upstreams:
            raise InvalidArgument("routing needs at least one --upstream NAME=URL,events=ENDPOINT")
        names = [u.name for u in upstreams]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidArgument(f"upstream name {dup!r} is given twice; names must be unique")
        if block_size is None:
            block_size = _learn_block_size(upstreams)
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        self.hasher = PrefixHasher(block_size, seed)
        self.block_size = block_size
        # An upstream engine loads a prefix from the pool when its own scheduler takes the
        # request (its KV connector), not when it accepts it: priced as a fetch at dequeue
        # (no prefetch room) unless the caller says otherwise.
        kw = {"prefetch_staging_bytes": 0.0, **conductor_kw}
        self.conductor = Conductor(ConductorConfig(block_size=block_size, policy=policy, rejection=rejection,
                                                   ttft_slo_s=ttft_slo_s, seed=seed, **kw))
        # Far more than any engine runs: decode admission is not ours to judge (module doc).
        self.conductor.add_decode(DECODE_SLOT, max_batch=1 << 20, kv_capacity_tokens=1 << 40)
        self._clock = clock
        self.down_cooldown_s = down_cooldown_s
        self._t0 = clock()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards the counters below; held for no I/O
        self._by_slot: dict[int, _Upstream] = {}
        self._by_name: dict[str, _Upstream] = {}
        target = TierTarget(self.conductor.index)
        for slot, spec in enumerate(upstreams):
            self.conductor.add_prefill(slot)
            up = _Upstream(spec, slot, Ingestor(target, slot, self.hasher, map_capacity))
            self._by_slot[slot] = self._by_name[spec.name] = up
        self.lora_adapters: set[str] = set()
        """Model names the upstreams serve as LoRA adapters (a request naming one is hashed
        with the adapter folded in, as the engine partitions its cache)."""
        self._subscribed = False
        if subscribe:
            self.subscribe()

    def subscribe(self) -> None:
        """Start one KV event subscriber thread per upstream that has ``events=``."""
        if self._subscribed:
            return
        from ..kv_events.subscriber import KVEventSubscriber  # pyzmq only when events are used

        self._subscribed = True
        from .engine_info import lora_adapters

        for up in self._by_slot.values():
            self.lora_adapters |= lora_adapters(up.spec.url)
            if up.spec.events:
                up.subscriber = KVEventSubscriber(up.spec.events, up.ingestor, replay_endpoint=up.spec.replay)
                up.subscriber.start()

    def close(self) -> None:
        for up in self._by_slot.values():
            if up.subscriber is not None:
                up.subscriber.stop()
                up.subscriber = None

    def __enter__(self) -> "UpstreamRouter":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- introspection
    @property
    def names(self) -> list[str]:
        return [u.spec.name for u in self._by_slot.values()]

    def ingestor(self, name: str) -> Ingestor:
        return self._up(name).ingestor

    def _up(self, name: str) -> _Upstream:
        up = self._by_name.get(name)
        if up is None:
            raise InvalidArgument(f"no upstream named {name!r}; the upstreams are {self.names}")
        return up

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None = None,
                     lora_name: str | None = None) -> BlockHashes | list[int]:
        """Our hashes of the prompt's full blocks, partitioned as the engines partition their
        caches: a request's ``cache_salt`` and LoRA adapter are folded in (vLLM's extra keys).
        The index and the conductor take either form; the plain prompt's stays in Rust."""
        ids = list(prompt_ids)
        if cache_salt is None and lora_name is None:
            return self.hasher.hash_blocks(ids)
        extras = vllm_block_extras(len(ids) // self.block_size, cache_salt=cache_salt, lora_name=lora_name)
        return self.hasher.hash(ids, extras=extras)

    def held_blocks(self, name: str, prompt_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> int:
        """How many leading full blocks of ``prompt_ids`` the index says ``name`` holds."""
        got = self.conductor.index.match_prefix(self.block_hashes(prompt_ids, cache_salt, lora_name))
        return int(got.get(self._up(name).slot, 0))

    def stats(self) -> dict[str, dict[str, Any]]:
        now = self._now()
        with self._lock:
            # "down" until the cooldown ends (the next route puts it back in the conductor)
            out: dict[str, dict[str, Any]] = {
                u.spec.name: {"slot": u.slot, "in_flight": u.in_flight, "routed": u.routed, "failures": u.failures,
                              "down": u.down_until is not None and now < u.down_until} for u in self._by_slot.values()}
        for u in self._by_slot.values():
            out[u.spec.name]["ingest"] = vars(u.ingestor.stats())
            if u.subscriber is not None:
                out[u.spec.name]["events"] = vars(u.subscriber.stats)
        return out

    # ---- lifecycle of one request
    def _now(self) -> float:
        return self._clock() - self._t0

    def route(self, prompt_ids: Sequence[int], expected_output_len: int | None = None, *,
              cache_salt: str | None = None, lora_name: str | None = None) -> Route:
        """Schedules a prompt; raises ``Overloaded`` (-> 429) when the conductor refuses it.

        ``cache_salt`` (the OpenAI request's field) and ``lora_name`` (an adapter the
        request names as its model) partition the cache as the engine does."""
        ids = list(prompt_ids)
        if not ids:
            raise InvalidArgument("the prompt encodes to no tokens; send some text")
        self._revive()
        rid = next(self._ids)
        d = self.conductor.schedule(rid, self.block_hashes(ids, cache_salt, lora_name), len(ids), self._now(),
                                    expected_output_len=expected_output_len)
        up = self._by_slot[d.prefill]
        with self._lock:
            up.in_flight += 1
            up.routed += 1
        return Route(rid, up.spec.name, up.spec.url, up.slot, d.reused_blocks, len(ids))

    def mark_down(self, r: Route) -> bool:
        """``r``'s upstream cannot be reached: take it out of routing for ``down_cooldown_s``
        (its index entries go; its events rebuild them once it is back). True if some
        other upstream is still up (worth routing the request again)."""
        up = self._by_slot[r.slot]
        if up.down_until is None:
            log.warning("upstream %r (%s) is unreachable; out of routing for %.1fs", up.spec.name, up.spec.url,
                        self.down_cooldown_s)
            # The requests still in flight there keep their Route; their conductor
            # entries go with the instance (``first_token``/``finish`` tolerate that).
            self.conductor.remove_instance(up.slot)
        up.down_until = self._now() + self.down_cooldown_s
        return any(u.down_until is None for u in self._by_slot.values())

    def _revive(self) -> None:
        now = self._now()
        for up in self._by_slot.values():
            if up.down_until is not None and now >= up.down_until:
                up.down_until = None
                self.conductor.add_prefill(up.slot)
                log.info("upstream %r back in routing", up.spec.name)

    def first_token(self, r: Route) -> None:
        """The upstream answered (its first token or its whole non-streamed answer)."""
        if r._state != "queued":
            return
        now = self._now()
        r._state = "decoding"
        try:
            self.conductor.on_prefill_started(r.request_id, now)
            self.conductor.on_prefill_finished(r.request_id, now)
            self.conductor.on_decode_started(r.request_id, now)
        except InvalidArgument:  # its upstream was marked down meanwhile: the conductor forgot it
            r._state = "gone"

    def finish(self, r: Route, output_tokens: int | None = None, *, failed: bool = False) -> None:
        """The request is over (done, failed or abandoned); idempotent."""
        if r._state == "done":
            return
        try:
            if r._state == "decoding" and not failed and output_tokens is not None:
                self.conductor.on_decode_finished(r.request_id, max(0, output_tokens), self._now())
            elif r._state != "gone":
                self.conductor.cancel(r.request_id)
        except InvalidArgument:  # dropped with its upstream (mark_down)
            pass
        r._state = "done"
        with self._lock:
            up = self._by_slot[r.slot]
            up.in_flight -= 1
            up.failures += failed
