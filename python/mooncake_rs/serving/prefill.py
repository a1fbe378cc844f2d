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

import numpy as np

from ..errors import StoreFull
from .control import Msg
from .transport import CopyJob

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
    dst_buf: np.ndarray | None
    t_start: float
    leases: list[int] = field(default_factory=list)
    new_slots: dict[int, int] = field(default_factory=dict)  # block -> reserved slot
    private: dict[int, np.ndarray] = field(default_factory=dict)  # blocks without a slot
    partial: np.ndarray | None = None
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
        st = _PState(rid, keys, len(prompt), dest, inst.transport.peer(dest["arena"]) if dest else None, inst.now())
        self.reqs[rid] = st
        slots: list[int] = []
        for k in keys[:msg.get("local", 0)]:
            s = store.lookup(k)
            if s is None:
                break
            slots.append(s)
        fetch = msg.get("fetch")
        if fetch and len(slots) == msg.get("local", 0):
            src = inst.transport.peer(fetch["arena"])
            for k, off in zip(fetch["keys"], fetch["offsets"]):
                s = store.lookup(k)
                if s is None:
                    try:
                        s = store.reserve()
                    except StoreFull:
                        break
                    inst.transport.copy_now(CopyJob(rid, store.buf, store.offset(s), src, off, store.block_bytes))
                    s = store.commit(s, k, lease=True)
                    st.fetched += 1
                slots.append(s)
        if fetch:
            inst.ch.send({"op": "fetched", "rid": rid, "holder": fetch["holder"]})
        usable = (len(prompt) - 1) // bs
        for s in slots[usable:]:
            store.release(s)
        slots = slots[:usable]
        st.leases, st.reused = slots, len(slots)
        st.fetched = min(st.fetched, st.reused)
        for i, s in enumerate(slots):  # reused blocks travel right away, while the rest computes
            self._send(st, i, store.buf, store.offset(s), 0, store.block_bytes)
        stream = inst.spec.stream_layers
        inst.engine.add_request(prompt, msg["params"], request_id=str(rid),
                                restored_kv=[store.view(s) for s in slots], prefill_only=True, hold_kv=True,
                                on_layer=functools.partial(self._on_layer, st) if stream else None)
        inst.ch.send({"op": "prefill_started", "rid": rid})

    def _send(self, st: _PState, block: int, src: np.ndarray, src_off: int, span_off: int, n: int) -> None:
        if st.dest is None or st.dst_buf is None:
            return
        if block < len(st.keys):
            off = st.dest["blocks"][block]
        else:
            off = st.dest.get("partial")
        if off is None:  # the decode instance already holds this block
            return
        self.inst.transport.submit(CopyJob(st.rid, st.dst_buf, off + span_off, src, src_off + span_off, n))

    def _block_buf(self, st: _PState, i: int) -> tuple[np.ndarray, int]:
        store = self.inst.store
        if i in st.new_slots:
            return store.buf, store.offset(st.new_slots[i])
        if i in st.private:
            return st.private[i], 0
        try:
            s = store.reserve()
        except StoreFull:
            st.private[i] = np.empty(store.block_bytes, dtype=np.uint8)
            return st.private[i], 0
        st.new_slots[i] = s
        return store.buf, store.offset(s)

    def _save(self, st: _PState, blocks: tuple[int, ...] | range, partial: int | None, layer: int | None) -> None:
        inst = self.inst
        layout = inst.layout
        span_off, n = (0, layout.block_nbytes) if layer is None else (layout.layer_span(layer).offset,
                                                                    layout.layer_nbytes)
        for i in blocks:
            if i < st.reused:
                continue
            buf, off = self._block_buf(st, i)
            inst.engine.save_block(str(st.rid), i, buf[off:off + layout.block_nbytes], layer)
            self._send(st, i, buf, off, span_off, n)
        if partial is not None:
            if st.partial is None:
                st.partial = np.zeros(layout.block_nbytes, dtype=np.uint8)
            inst.engine.save_block(str(st.rid), partial, st.partial, layer)
            self._send(st, partial, st.partial, 0, span_off, n)

    def _on_layer(self, st: _PState, ev: "LayerEvent") -> None:
        self._save(st, ev.blocks, ev.partial_block, ev.layer)

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
                self._save(st, range(nfull), partial, None)
            st.done = True

    def poll(self) -> None:
        for rid in [r for r, st in self.reqs.items() if st.done and not self.inst.transport.pending(r)]:
            self._complete(self.reqs.pop(rid))

    def _complete(self, st: _PState) -> None:
        inst, store = self.inst, self.inst.store
        for i, s in st.new_slots.items():
            store.commit(s, st.keys[i]) if i < len(st.keys) else store.abandon(s)
        for s in st.leases:
            store.release(s)
        inst.engine.release(str(st.rid))
        inst.ch.send({"op": "prefilled", "rid": st.rid, "first": st.first, "finish": st.finish,
                      "reused_blocks": st.reused, "fetched_blocks": st.fetched,
                      "bytes": inst.transport.take_bytes(st.rid), "t_start": st.t_start,
                      "t_compute": st.t_compute, "t_ready": inst.now()})

    def _cancel(self, rid: int) -> None:
        st = self.reqs.pop(rid, None)
        if st is None:
            return
        inst = self.inst
        inst.engine.abort(str(rid))
        inst.engine.release(str(rid))
        while inst.transport.pending(rid):  # copies from our slots must end before reuse
            time.sleep(0.001)
        for s in st.new_slots.values():
            inst.store.abandon(s)
        for s in st.leases:
            inst.store.release(s)
        inst.transport.take_bytes(rid)
