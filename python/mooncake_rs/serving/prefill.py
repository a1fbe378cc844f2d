"""Prefill behaviour of an instance.

For each request the cluster sends (``op: prefill``): take the prefix blocks this
instance holds, fetch the ones the decision names from their holder into the local
store (one copy from the holder's arena), load them all into pages through
``Engine.add_request(restored_kv=...)``, and compute the rest in chunks. After each layer
of each step, ``on_layer`` saves that layer's part of every newly completed full block
into a reserved store slot and queues its copy into the slot the decode instance
reserved, so sending overlaps the next layers' compute. The partial last block (no
hash) goes to a request-scoped slot of the decode instance. When the engine has the
first token and every copy is done, the new blocks are committed (store events ->
conductor index) and the cluster is told ``prefilled``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import MooncakeError
from .control import Msg
from .transport import Span

if TYPE_CHECKING:
    from ..engine import LayerEvent, RequestOutput
    from .instance import Instance

__all__ = ["PrefillRole"]


@dataclass
class _PState:
    rid: int
    keys: list[int]
    prompt_len: int
    dest: dict[str, Any] | None
    t_start: float
    leases: list[Any] = field(default_factory=list)  # Blocks held (reused prefix)
    new_slots: dict[int, Any] = field(default_factory=dict)  # block -> WritableBlock being filled
    partial: Any = None  # WritableBlock of the partial last block (request-scoped, never committed)
    error: str | None = None
    reused: int = 0
    fetched: int = 0
    first: int | None = None
    finish: str | None = None
    done: bool = False
    t_compute: float = 0.0


class PrefillRole:
    def __init__(self, inst: "Instance") -> None:
        self.inst = inst
        self.reqs: dict[int, _PState] = {}

    def busy(self) -> bool:
        return any(st.done for st in self.reqs.values())

    def tracked(self) -> int:
        """Requests this role still holds state (pages, leases, slots) for."""
        return len(self.reqs)

    # ---- messages
    def handle(self, msg: Msg) -> None:
        op = msg["op"]
        if op == "prefill":
            self._start(msg)
        elif op == "cancel":
            self._cancel(msg["rid"])

    def _start(self, msg: Msg) -> None:
        inst, store = self.inst, self.inst.store
        rid, keys, prompt = msg["rid"], list(msg["keys"]), msg["prompt"]
        bs = inst.spec.block_size
        dest = msg.get("dest")
        st = _PState(rid, keys, len(prompt), dest, inst.now())
        self.reqs[rid] = st
        slots: list[Any] = []
        for k in keys[:msg.get("local", 0)]:
            s = store.lookup(k)
            if s is None:
                break
            slots.append(s)
        fetch = msg.get("fetch")
        if fetch and len(slots) == msg.get("local", 0):
            for k, off in zip(fetch["keys"], fetch["offsets"]):
                s = store.lookup(k)
                if s is None:
                    try:
                        wb = store.reserve(k)
                    except MooncakeError:
                        break
                    try:
                        inst.transport.read_now(rid, fetch["arena"], [Span(wb.offset, off, store.block_bytes)])
                    except (MooncakeError, OSError):  # the holder is gone: compute the rest
                        wb.abort()
                        break
                    s = store.commit(wb, lease=True)
                    if s is None:
                        break
                    st.fetched += 1
                slots.append(s)
        if fetch:
            inst.ch.send({"op": "fetched", "rid": rid, "holder": fetch["holder"]})
        usable = (len(prompt) - 1) // bs
        for s in slots[usable:]:
            s.release()
        slots = slots[:usable]
        st.leases, st.reused = slots, len(slots)
        st.fetched = min(st.fetched, st.reused)
        spans: list[Span] = []
        for i, s in enumerate(slots):  # reused blocks travel right away, while the rest computes
            self._span(st, i, store.offset(s), 0, store.block_bytes, spans)
        self._write(st, spans)
        stream = inst.spec.stream_layers
        inst.engine.add_request(prompt, msg["params"], request_id=str(rid),
                                restored_kv=[store.view(s) for s in slots], prefill_only=True, hold_kv=True,
                                on_layer=functools.partial(self._on_layer, st) if stream else None)
        inst.ch.send({"op": "prefill_started", "rid": rid})

    def _span(self, st: _PState, block: int, src_off: int, span_off: int, n: int, out: list[Span]) -> None:
        if st.dest is None:
            return
        off = st.dest["blocks"][block] if block < len(st.keys) else st.dest.get("partial")
        if off is not None:  # None: the decode instance already holds this block
            out.append(Span(src_off + span_off, off + span_off, n))

    def _write(self, st: _PState, spans: list[Span]) -> None:
        if spans and st.dest is not None:
            self.inst.transport.write(st.rid, st.dest["arena"], spans)

    def _slot(self, st: _PState, i: int) -> Any:
        if i < len(st.keys):
            if i not in st.new_slots:
                st.new_slots[i] = self.inst.store.reserve(st.keys[i])
            return st.new_slots[i]
        if st.partial is None:
            st.partial = self.inst.store.reserve_scratch(st.rid)
        return st.partial

    def _save(self, st: _PState, blocks: tuple[int, ...] | range, partial: int | None, layer: int | None) -> None:
        inst, store = self.inst, self.inst.store
        layout = inst.layout
        span_off, n = (0, layout.block_nbytes) if layer is None else (layout.layer_span(layer).offset,
                                                                    layout.layer_nbytes)
        spans: list[Span] = []
        todo = [i for i in blocks if i >= st.reused] + ([partial] if partial is not None else [])
        for i in todo:
            s = self._slot(st, i)
            inst.engine.save_block(str(st.rid), i, store.view(s), layer)
            self._span(st, i, store.offset(s), span_off, n, spans)
        self._write(st, spans)

    def _on_layer(self, st: _PState, ev: "LayerEvent") -> None:
        if st.error is not None:
            return
        try:
            self._save(st, ev.blocks, ev.partial_block, ev.layer)
        except Exception as e:  # noqa: BLE001 - never break the engine's step; fail the request
            st.error = f"{type(e).__name__}: {e}"

    # ---- engine outputs and completion
    def on_outputs(self, outs: list["RequestOutput"]) -> None:
        bs = self.inst.spec.block_size
        for out in outs:
            st = self.reqs.get(int(out.request_id))
            if st is None or not out.finished:
                continue
            st.first = out.token_ids[0] if out.token_ids else None
            st.finish = out.finish_reason
            st.t_compute = self.inst.now()
            if not self.inst.spec.stream_layers and st.finish == "prefill":
                nfull = st.prompt_len // bs
                partial = nfull if st.prompt_len % bs else None
                try:
                    self._save(st, range(nfull), partial, None)
                except Exception as e:  # noqa: BLE001 - fail the request, not the instance
                    st.error = f"{type(e).__name__}: {e}"
            st.done = True

    def poll(self) -> None:
        for rid in [r for r, st in self.reqs.items() if st.done and not self.inst.transport.pending(r)]:
            self._complete(self.reqs.pop(rid))

    def _complete(self, st: _PState) -> None:
        inst, store = self.inst, self.inst.store
        err = st.error or inst.transport.error(st.rid)
        for wb in st.new_slots.values():
            if err is None:
                store.commit(wb)
            else:
                wb.abort()
        if st.partial is not None:
            st.partial.abort()
        for s in st.leases:
            s.release()
        inst.engine.release(str(st.rid))
        if err is not None:
            inst.transport.take_bytes(st.rid)
            inst.ch.send({"op": "failed", "rid": st.rid, "error": f"KV hand-off failed: {err}"})
            return
        inst.flush_store_events()  # the index learns the new blocks before the request ends
        inst.ch.send({"op": "prefilled", "rid": st.rid, "first": st.first, "finish": st.finish,
                      "reused_blocks": st.reused, "fetched_blocks": st.fetched,
                      "bytes": inst.transport.take_bytes(st.rid), "t_start": st.t_start,
                      "t_compute": st.t_compute, "t_ready": inst.now()})

    def _cancel(self, rid: int) -> None:
        try:
            self._drop(rid)
        finally:
            # The router holds back the decode instance's cancel (which frees the slots we
            # write into) and the holder's unpin (of the slots we read) until this ack.
            self.inst.ch.send({"op": "cancelled", "rid": rid})

    def _drop(self, rid: int) -> None:
        st = self.reqs.pop(rid, None)
        if st is None:
            return
        inst = self.inst
        inst.engine.abort(str(rid))
        inst.engine.release(str(rid))
        while inst.transport.pending(rid):  # copies from our slots must end before reuse
            time.sleep(0.001)
        for wb in st.new_slots.values():
            wb.abort()
        if st.partial is not None:
            st.partial.abort()
        for s in st.leases:
            s.release()
        inst.transport.take_bytes(rid)
