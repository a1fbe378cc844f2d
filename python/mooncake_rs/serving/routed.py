"""``RoutedCluster``: the request side of a deployment that routes with a conductor and
the router thread, whatever runs its instances.

The embedded ``Cluster`` (instances in this process or in child processes) and the
``serve`` process's ``ConductorService`` (workers on other hosts, found in etcd) both
are one: they differ in how instances start, join and leave, not in how a request is
admitted and followed. A subclass provides ``conductor``, ``_router``, ``_limits``,
``_hasher``, ``_members`` (instance id -> a member with ``alive``, ``spec``, ``ch``),
``metrics``, ``prefix_reuse`` and ``_closed``; ``multipath`` (multi-source prefix
fetches) is off unless the subclass turns it on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Callable, Self

from .._core import Conductor, ConductorConfig, DecodeCostModel, TransferCostModel
from ..errors import InvalidArgument, Overloaded
from .generate import GenerateMixin
from .handle import RequestHandle, request_entry
from .lifecycle import CancelRequest, Plan
from .limits import Limits
from .metrics import ClusterMetrics
from .router import RequestRecord, Router

__all__ = ["RoutedCluster", "new_conductor", "request_output", "MAX_FETCH_SOURCES"]

#: the most holders one prefix fetch reads from at once (the decision's holder included):
#: past a few, each share is too small to gain more than the extra Export round trips cost
MAX_FETCH_SOURCES = 4


def request_output(record: RequestRecord, reason: str) -> Any:
    """The ``RequestOutput`` of a finished request (``ClusterPort.output``). The record is
    dropped once finished: its token list is handed over, not copied."""
    from ..base.outputs import RequestOutput

    m = record.metrics
    return RequestOutput(str(record.plan.rid), record.plan.prompt, record.tokens, reason, [], m.reused_tokens, 0, m)


def new_conductor(cfg_args: dict[str, Any], block_bytes: int, prefill_model: Any, prefill_ids: Sequence[int],
                  decode_ids: Sequence[int], index: Any = None, decode_capacity: tuple[int, int] | None = None,
                  link_bandwidth: float | None = None) -> Conductor:
    """A conductor over these instances. ``cfg_args``: ``ConductorConfig``'s keywords
    (block size, SLOs, policy, rejection, seed); the transfer cost of a token follows
    the instances' block bytes. ``decode_capacity``: (largest batch, KV tokens) of a
    decode instance, what admission fills them to (None: the conductor's defaults, until
    the instances said). With rejection on, the admission's estimates are calibrated
    online on what this cluster measures (conductor.md, admission). ``link_bandwidth``
    (the instances' emulated links, bytes/s): the network the conductor prices fetches
    on, and every instance's NIC capacity in its link loads (issue 25; docs/conductor.md)."""
    per_token = block_bytes / cfg_args["block_size"]
    cfg = ConductorConfig(
        **cfg_args, prefill_model=prefill_model,
        transfer_model=TransferCostModel(bytes_per_token=per_token,
                                         network_bandwidth=2e9 if link_bandwidth is None else link_bandwidth,
                                         latency_s=1e-4),
        decode_model=DecodeCostModel(base_s=0.004, per_seq_s=2e-4, per_token_s=1e-7),
        default_output_len=32)
    c = Conductor(cfg, index)
    c.set_online_calibration(cfg_args.get("rejection", "none") != "none")
    for i in prefill_ids:
        c.add_prefill(i)
    for i in decode_ids:
        if decode_capacity is None:
            c.add_decode(i)
        else:
            c.add_decode(i, max_batch=max(1, decode_capacity[0]), kv_capacity_tokens=max(1, decode_capacity[1]))
    if link_bandwidth is not None:
        for i in (*prefill_ids, *decode_ids):
            c.set_link_bandwidth(i, link_bandwidth, float("inf"))
    return c


class RoutedCluster(GenerateMixin):
    #: fetch a reused prefix from every prefill instance that holds it, at once
    #: (multisource.py); off: from the one holder the conductor's decision names
    multipath: bool = False
    conductor: Any
    metrics: ClusterMetrics
    prefix_reuse: bool
    _closed: bool
    _members: dict[int, Any]
    _router: Router
    _limits: Limits
    _hasher: Any  # PrefixHasher

    def _init_routing(self) -> None:
        self._ids = itertools.count(1)
        self._t0 = time.monotonic()
        self.metrics = ClusterMetrics()
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def instances(self) -> dict[int, str]:
        """Live instances: id -> name."""
        return {i: m.spec.name for i, m in list(self._members.items()) if m.alive}

    def instance_roles(self) -> dict[int, str]:
        """Live instances: id -> ``"prefill"`` or ``"decode"``."""
        names = self.instances()
        return {i: m.spec.role for i, m in list(self._members.items()) if i in names}

    def submit(self, prompt: Sequence[int], params: Any = None, *, timeout_s: float | None = None) -> RequestHandle:
        """Admits one request and returns its handle; raises ``Overloaded`` when rejected
        and ``InvalidArgument`` for a prompt no instance could serve. ``timeout_s``: a
        deadline from now; past it the request is cancelled on every instance and fails
        with ``TransferTimeout`` (None: no deadline)."""
        return self._submit(prompt, params, timeout_s, RequestHandle)

    def _submit(self, prompt: Sequence[int], params: Any, timeout_s: float | None,
                handle_type: Callable[[int, list[int], Any], RequestHandle]) -> Any:
        """``submit`` with the handle's maker: ``handle_type(rid, prompt, on_cancel)``
        (the conductor service forwards a remote client's tokens through its own)."""
        if self._closed:
            raise InvalidArgument("the cluster is closed")
        toks, params, wait = request_entry(prompt, params, timeout_s)
        self._limits.check(toks, params)
        keys = self._hasher.hash_blocks(toks)  # BlockHashes: no Python int per block
        rid = next(self._ids)
        self.metrics.count("requests")
        try:
            d = self.conductor.schedule(rid, keys if self.prefix_reuse else [], len(toks), self._now(),
                                        expected_output_len=params.max_tokens)
        except Overloaded:
            self.metrics.count("rejected")
            raise
        t_submit = time.monotonic()
        local = d.reused_blocks - d.fetch_blocks
        fetch = d.fetch_blocks > 0 and d.fetch_from is not None
        also = self._other_holders(keys[:d.reused_blocks], d) if fetch and self.multipath else ()
        plan = Plan(rid, toks, params, bytes(keys), d.prefill, d.decode, local=local,
                    fetch_from=d.fetch_from if fetch else None,
                    fetch_keys=bytes(keys[local:d.reused_blocks]) if fetch else b"",
                    deadline=None if wait is None else t_submit + wait, timeout_s=0.0 if wait is None else wait,
                    fetch_also=also)
        rec = RequestRecord(plan, handle_type(rid, toks, self._cancel), t_submit)
        rec.metrics.prefill_instance, rec.metrics.decode_instance = d.prefill, d.decode
        rec.handle.prefill_instance, rec.handle.decode_instance = d.prefill, d.decode
        rec.metrics.prompt_tokens = len(toks)
        self._router.submit(rec)
        return rec.handle

    def _other_holders(self, prefix: Any, d: Any) -> tuple[int, ...]:
        """Live prefill instances besides the decision's holder that the index says hold
        all of ``prefix`` (the request's reused blocks, from the first): the other sources
        of a multi-source fetch. A holder the index is wrong about answers ``Exported``
        with fewer blocks and is left out of the fetch then (lifecycle.py)."""
        want = len(prefix)
        held = self.conductor.index.match_prefix(prefix)
        out = []
        for i, n in sorted(held.items()):
            if n < want or i in (d.prefill, d.decode, d.fetch_from):
                continue
            m = self._members.get(i)
            if m is None or not m.alive or m.spec.role != "prefill":
                continue
            out.append(i)
            if len(out) + 1 >= MAX_FETCH_SOURCES:
                break
        return tuple(out)

    def _cancel(self, rid: int, error: BaseException, outcome: str = "cancelled") -> None:
        """RequestHandle.cancel: the router ends the request everywhere (lifecycle.py);
        ``outcome`` is the metrics counter it lands in."""
        self._router.post(CancelRequest(rid, error, outcome))

    def metrics_text(self) -> str:
        """Prometheus text exposition of the cluster's totals and instance gauges."""
        snap = self.conductor.snapshot(self._now())
        gauges: dict[str, float] = {"instances_alive": float(len(self.instances()))}
        for p in snap.prefill:
            gauges[f'prefill_queue_seconds{{instance="{p.id}"}}'] = p.queue_s
        for d in snap.decode:
            gauges[f'decode_batch{{instance="{d.id}"}}'] = float(d.batch)
        gauges["requests_in_flight"] = float(snap.requests)
        gauges["prefix_hit_rate"] = self.metrics.prefix_hit_rate
        for i, u in self.kv_usage().items():
            for name, v in u.items():
                gauges[f'{name}{{instance="{i}"}}'] = v
        return self.metrics.prometheus(gauges)

    def kv_usage(self) -> dict[int, dict[str, float]]:
        """Per live instance, its memory use as of its latest heartbeat (no round trip:
        cheap enough for every ``/metrics`` scrape): ``kv_used_blocks`` / ``kv_free_blocks``
        (its engine's KV cache pages, a block of tokens each), ``store_used_blocks`` /
        ``store_slots`` / ``store_used_bytes`` (its store's DRAM tier), ``engine_running`` /
        ``engine_waiting`` (its engine scheduler's sequences) and ``heartbeat_age_seconds``.
        An instance that has not beaten yet (or with ``heartbeat_timeout_s=None`` in
        worker processes, which then send no beats) is left out."""
        out: dict[int, dict[str, float]] = {}
        now = time.monotonic()
        for i, m in list(self._members.items()):
            b = getattr(m.ch, "last_beat", None)
            if not m.alive or b is None or b.kv_pages < 0:
                continue
            out[i] = {"kv_used_blocks": float(b.kv_pages - b.kv_free_pages), "kv_free_blocks": float(b.kv_free_pages),
                      "store_used_blocks": float(b.store_blocks), "store_slots": float(b.store_slots),
                      "store_used_bytes": float(b.store_bytes), "engine_running": float(b.running),
                      "engine_waiting": float(b.waiting), "heartbeat_age_seconds": now - m.ch.last_seen}
        return out
