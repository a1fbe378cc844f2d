"""The cluster's router thread: every request's life, driven by instance messages.

new -> ``expect`` to the decode instance (reserve slots) and, when the decision fetches
a prefix, ``export`` to its holder (pin it, name offsets) -> both answered -> ``prefill``
to the prefill instance -> ``prefilled`` (first token; KV all sent) -> ``decode`` to the
decode instance -> ``tokens`` ... -> finished. A ``dead`` instance fails the requests it
was serving (prefill or decode) at once, the conductor drops it, the rest go on; a
holder that dies before answering ``export`` just means no fetch.

Ending a request early (failure, deadline, ``RequestHandle.cancel``) cancels it on every
instance, in an order that keeps slots safe: while its prefill may still be copying KV
into the decode instance's reserved slots (or reading the holder's pinned ones), the
prefill instance is cancelled first and the decode cancel and holder unpin wait for its
``cancelled`` ack (or its death), so no slot is freed while a peer still touches it.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Any

from ..errors import MooncakeError, TransferFailed, TransferTimeout
from .control import Msg
from .metrics import tbt_of

if TYPE_CHECKING:
    from .cluster import Cluster, _Req

__all__ = ["Router"]

log = logging.getLogger("mooncake_rs.serving")

_WATCH_S = 0.25  # how often worker processes are polled for an exit the socket missed


class Router:
    def __init__(self, cluster: "Cluster") -> None:
        self.c = cluster
        # rid -> (prefill instance, messages held back until it acks the cancel)
        self._after_cancel: dict[int, tuple[int, list[tuple[int, Msg]]]] = {}

    def run(self) -> None:
        last_watch = time.monotonic()
        while True:
            try:
                inst, msg = self.c._events.get(timeout=_WATCH_S)
            except queue.Empty:
                inst, msg = -1, {"op": "tick"}
            if msg["op"] == "shutdown":
                return
            try:
                self.handle(inst, msg)
            except Exception:  # keep routing; the request at fault is failed below
                log.exception("router: %s from %s", msg.get("op"), inst)
                rid = msg.get("rid")
                if isinstance(rid, int):
                    self._fail(rid, MooncakeError(f"internal error handling {msg.get('op')}"))
            if time.monotonic() - last_watch > _WATCH_S:
                last_watch = time.monotonic()
                self._watch()

    def _req(self, rid: Any) -> "_Req | None":
        with self.c._lock:
            return self.c._reqs.get(rid)

    def _send(self, inst: int, msg: Msg) -> None:
        m = self.c._members.get(inst)
        if m is not None and m.alive:
            m.ch.to_instance(msg)

    def handle(self, inst: int, msg: Msg) -> None:
        op = msg["op"]
        c = self.c
        if op == "tick":
            return
        if op == "ready":
            m = c._members[inst]
            m.arena = msg["arena"]
            m.info = msg
            m.ready.set()
            return
        if op == "init_failed":
            m = c._members[inst]
            m.error = msg["error"]
            m.ready.set()
            return
        if op == "dead":
            self._dead(inst, msg.get("error"))
            return
        if op == "store":
            self._store_events(inst, msg["events"])
            return
        if op == "measured":
            c._measured.put(msg)
            return
        rid = msg.get("rid")
        if op == "failed" and rid is None:
            c._measured.put({"error": msg.get("error")})
            return
        if op == "cancelled":
            self._release_after_cancel(rid)
            return
        req = self._req(rid)
        if req is None:
            if op == "exported":  # the request ended while its holder was pinning: unpin
                self._send(inst, {"op": "unpin", "rid": rid})
            return
        getattr(self, "_on_" + op)(req, inst, msg)

    # ---- request stages
    def _on_new(self, req: "_Req", inst: int, msg: Msg) -> None:
        d = req.decision
        nfull = len(req.prompt) // self.c.block_size
        self._send(d.decode, {"op": "expect", "rid": req.rid, "keys": req.keys[:nfull],
                              "partial": len(req.prompt) % self.c.block_size != 0})
        if d.fetch_blocks and d.fetch_from is not None and self.c._members[d.fetch_from].alive:
            local = d.reused_blocks - d.fetch_blocks
            req.wait_fetch = True
            self._send(d.fetch_from, {"op": "export", "rid": req.rid, "keys": req.keys[local:d.reused_blocks]})

    def _on_expected(self, req: "_Req", inst: int, msg: Msg) -> None:
        req.dest = msg
        self._maybe_dispatch(req)

    def _on_exported(self, req: "_Req", inst: int, msg: Msg) -> None:
        d = req.decision
        local = d.reused_blocks - d.fetch_blocks
        n = len(msg["offsets"])
        req.fetch = {"arena": msg["arena"], "offsets": msg["offsets"], "keys": req.keys[local:local + n],
                     "holder": inst} if n else None
        if not n:
            self._send(inst, {"op": "unpin", "rid": req.rid})
        req.wait_fetch = False
        self._maybe_dispatch(req)

    def _maybe_dispatch(self, req: "_Req") -> None:
        if req.dispatched or req.dest is None or req.wait_fetch:
            return
        req.dispatched = True
        d = req.decision
        self._send(d.prefill, {"op": "prefill", "rid": req.rid, "prompt": req.prompt, "params": req.params,
                               "keys": req.keys, "local": d.reused_blocks - d.fetch_blocks, "fetch": req.fetch,
                               "dest": {"arena": req.dest["arena"], "blocks": req.dest["blocks"],
                                        "partial": req.dest["partial"]}})

    def _on_fetched(self, req: "_Req", inst: int, msg: Msg) -> None:
        self._send(msg["holder"], {"op": "unpin", "rid": req.rid})

    def _on_prefill_started(self, req: "_Req", inst: int, msg: Msg) -> None:
        self._conductor("on_prefill_started", req.rid, self.c._now())

    def _on_prefilled(self, req: "_Req", inst: int, msg: Msg) -> None:
        c, bs, m = self.c, self.c.block_size, req.metrics
        now = time.monotonic()
        self._conductor("on_prefill_finished", req.rid, c._now())
        req.prefilled = True
        m.reused_tokens = msg["reused_blocks"] * bs
        m.fetched_tokens = msg["fetched_blocks"] * bs
        m.computed_tokens = len(req.prompt) - m.reused_tokens
        m.transferred_bytes += msg["bytes"]
        m.kv_ready_s = msg["t_ready"] - msg["t_start"]
        if msg["first"] is not None:
            m.ttft_s = now - req.t_submit
            req.t_last = now
            req.tokens.append(msg["first"])
            req.handle._token(msg["first"])
        if msg["finish"] != "prefill":
            self._send(req.decision.decode, {"op": "cancel", "rid": req.rid})
            self._finish(req, msg["finish"])
            return
        self._send(req.decision.decode, {"op": "decode", "rid": req.rid, "prompt": req.prompt,
                                         "first": msg["first"], "params": req.params})

    def _on_decode_started(self, req: "_Req", inst: int, msg: Msg) -> None:
        self._conductor("on_decode_started", req.rid, self.c._now())

    def _on_tokens(self, req: "_Req", inst: int, msg: Msg) -> None:
        now = time.monotonic()
        for t in msg["tokens"]:
            req.metrics.token_intervals.append(now - req.t_last)
            req.t_last = now
            req.tokens.append(t)
            req.handle._token(t)
        if msg["finish"] is not None:
            self._finish(req, msg["finish"])

    def _on_cancel_request(self, req: "_Req", inst: int, msg: Msg) -> None:
        self._fail(req.rid, msg["error"])

    def _on_failed(self, req: "_Req", inst: int, msg: Msg) -> None:
        self._fail(req.rid, MooncakeError(f"request {req.rid} failed on {self.c._members[inst].spec.name}: "
                                          f"{msg['error']}"))

    # ---- endings
    def _finish(self, req: "_Req", reason: str) -> None:
        from ..engine import RequestOutput

        c, m = self.c, req.metrics
        m.output_tokens = len(req.tokens)
        m.tbt_s = tbt_of(m.token_intervals)
        if reason in ("stop", "length"):
            self._conductor("on_decode_finished", req.rid, len(req.tokens), c._now())
        else:
            self._conductor("cancel", req.rid)
        with c._lock:
            c._reqs.pop(req.rid, None)
        req.finished = True
        c.metrics.add(m)
        req.handle._finish(RequestOutput(str(req.rid), req.prompt, list(req.tokens), reason, [], m.reused_tokens,
                                         0, m))

    def _fail(self, rid: int, error: BaseException) -> None:
        c = self.c
        with c._lock:
            req = c._reqs.pop(rid, None)
        if req is None:
            return
        req.finished = True
        d = req.decision
        later: list[tuple[int, Msg]] = [(d.decode, {"op": "cancel", "rid": rid})]
        if req.fetch is not None:
            later.append((req.fetch["holder"], {"op": "unpin", "rid": rid}))
        pm = c._members.get(d.prefill)
        if req.dispatched and not req.prefilled and pm is not None and pm.alive:
            self._after_cancel[rid] = (d.prefill, later)  # see the module docstring
            self._send(d.prefill, {"op": "cancel", "rid": rid})
        else:
            self._send(d.prefill, {"op": "cancel", "rid": rid})
            for i, m in later:
                self._send(i, m)
        self._conductor("cancel", rid)
        c.metrics.count("failed")
        req.handle._fail(error)

    def _dead(self, inst: int, error: str | None) -> None:
        c = self.c
        m = c._members.get(inst)
        if m is None or not m.alive:
            return
        m.alive = False
        if not m.ready.is_set():
            m.error = error or "the worker exited during start-up"
            m.ready.set()
        code = m.proc.poll() if m.proc is not None else None
        why = f"exit code {code}" if code is not None and code >= 0 else (
            f"signal {-code}" if code is not None else (error or "lost"))
        if m.down_reason is not None:  # the watchdog killed it (see liveness.py)
            what = m.down_reason
            try:
                if m.proc is not None:
                    m.proc.wait(5)  # SIGKILLed: reap it so its segments go now
            except Exception:  # noqa: BLE001 - swept at close() then
                pass
        else:
            what = f"died ({why})"
        if not c._closed:
            log.warning("serving: instance %s %s; failing its requests", m.spec.name, what)
        try:
            c.conductor.remove_instance(inst)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for rid in [r for r, (p, _) in self._after_cancel.items() if p == inst]:
            self._release_after_cancel(rid)  # a dead prefill copies nothing more
        err = TransferFailed(f"instance {m.spec.name} {what}; its in-flight requests failed")
        with c._lock:
            reqs = list(c._reqs.values())
        for r in reqs:
            d = r.decision
            if inst in (d.prefill, d.decode):
                self._fail(r.rid, err)
            elif r.wait_fetch and d.fetch_from == inst:
                r.wait_fetch = False
                self._maybe_dispatch(r)
        if m.proc is not None and m.proc.poll() is not None:
            from .cluster import remove_segments_of

            remove_segments_of(m.proc.pid)

    def _release_after_cancel(self, rid: Any) -> None:
        _, later = self._after_cancel.pop(rid, (None, []))
        for i, m in later:
            self._send(i, m)

    def _watch(self) -> None:
        for i, m in self.c._members.items():
            if m.alive and m.proc is not None and m.proc.poll() is not None:
                self._dead(i, None)
        now = time.monotonic()
        with self.c._lock:
            late = [(r.rid, r.deadline - r.t_submit) for r in self.c._reqs.values()
                    if r.deadline is not None and now > r.deadline]
        for rid, after in late:
            self._fail(rid, TransferTimeout(f"request {rid} passed its deadline ({after:.3g}s after submit); "
                                            "it was cancelled"))

    # ---- conductor feed
    def _store_events(self, inst: int, events: list[tuple[str, int, str]]) -> None:
        if not self.c.prefix_reuse or not self.c._members[inst].alive:
            return
        # Consecutive events of one kind and tier go to the conductor as one call, in order
        # (a block may be stored, evicted and stored again within one batch).
        run: list[int] = []
        run_kind: tuple[str, str] | None = None
        for kind, key, tier in list(events) + [("end", 0, "")]:
            if (kind, tier) != run_kind and run and run_kind is not None:
                if run_kind[0] == "stored":
                    self.c.conductor.on_blocks_stored(inst, run, run_kind[1])
                else:
                    self.c.conductor.on_blocks_evicted(inst, run, run_kind[1])
                run = []
            run_kind = (kind, tier)
            run.append(key)

    def _conductor(self, method: str, *args: Any) -> None:
        try:
            getattr(self.c.conductor, method)(*args)
        except Exception:  # noqa: BLE001 - progress is advisory (a dropped instance, a recalibration)
            log.debug("conductor.%s%r failed", method, args, exc_info=True)
