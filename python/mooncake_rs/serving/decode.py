"""Decode behaviour of an instance.

``expect``: before a request's prefill starts, reserve a store slot for each of its full
prompt blocks that this instance does not hold yet, plus one request-scoped slot for the
partial last block, and name their offsets (the prefill instance writes into them, layer
by layer). ``decode``: once the prefill instance reports every byte sent, commit the
keyed slots, hand all the blocks to ``Engine.add_decode_request`` (the request joins the
continuous batch) and stream the tokens of each step back to the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import MooncakeError, StoreFull
from .control import Msg

if TYPE_CHECKING:
    from ..engine import RequestOutput
    from .instance import Instance

__all__ = ["DecodeRole"]


@dataclass
class _DState:
    keys: list[int]
    have: dict[int, Any] = field(default_factory=dict)  # block -> Block already held (leased)
    reserved: dict[int, Any] = field(default_factory=dict)  # block -> WritableBlock being filled
    partial: Any = None  # WritableBlock of the partial last block (request-scoped)


class DecodeRole:
    def __init__(self, inst: "Instance") -> None:
        self.inst = inst
        self.waiting: dict[int, _DState] = {}
        self.active: set[int] = set()

    def busy(self) -> bool:
        return False

    def tracked(self) -> int:
        """Requests this role still holds state (reserved slots, a running sequence) for."""
        return len(self.waiting) + len(self.active)

    def handle(self, msg: Msg) -> None:
        op = msg["op"]
        if op == "expect":
            self._expect(msg)
        elif op == "decode":
            self._decode(msg)
        elif op == "cancel":
            self._cancel(msg["rid"])

    def _expect(self, msg: Msg) -> None:
        store = self.inst.store
        rid = msg["rid"]
        st = _DState(list(msg["keys"]))
        self.waiting[rid] = st
        try:
            for i, k in enumerate(st.keys):
                s = store.lookup(k)
                if s is not None:
                    st.have[i] = s
                else:
                    st.reserved[i] = store.reserve(k)
            if msg["partial"]:
                st.partial = store.reserve_scratch(rid)
        except StoreFull as e:
            self._cancel(rid)
            self.inst.ch.send({"op": "failed", "rid": rid, "error": f"StoreFull: {e}"})
            return
        blocks = [None if i in st.have else store.offset(st.reserved[i]) for i in range(len(st.keys))]
        self.inst.ch.send({"op": "expected", "rid": rid, "arena": self.inst.endpoint, "blocks": blocks,
                           "partial": None if st.partial is None else store.offset(st.partial)})

    def _decode(self, msg: Msg) -> None:
        inst, store = self.inst, self.inst.store
        rid = msg["rid"]
        st = self.waiting.pop(rid)
        blocks = []
        for i, k in enumerate(st.keys):
            b = st.have[i] if i in st.have else store.commit(st.reserved.pop(i), lease=True)
            if b is None:
                raise MooncakeError(f"block {i} was evicted before decode started; raise dram_bytes_per_instance")
            blocks.append(b)
        st.have = dict(enumerate(blocks))
        try:
            views = [store.view(b) for b in blocks]
            if st.partial is not None:
                views.append(store.view(st.partial))
            inst.engine.add_decode_request(msg["prompt"], msg["first"], msg["params"], views, request_id=str(rid))
            del views  # the engine copied the KV into its pages
        finally:
            self._free(st)
        self.active.add(rid)
        inst.ch.send({"op": "decode_started", "rid": rid, "t": inst.now()})

    def on_outputs(self, outs: list["RequestOutput"]) -> None:
        for out in outs:
            rid = int(out.request_id)
            if rid not in self.active:
                continue
            self.inst.ch.send({"op": "tokens", "rid": rid, "tokens": list(out.new_token_ids),
                               "finish": out.finish_reason, "t": self.inst.now()})
            if out.finished:
                self.active.discard(rid)

    def poll(self) -> None:
        pass

    @staticmethod
    def _free(st: _DState) -> None:
        for b in st.have.values():
            b.release()
        for wb in st.reserved.values():
            wb.abort()
        if st.partial is not None:
            st.partial.abort()
        st.have, st.reserved, st.partial = {}, {}, None

    def _cancel(self, rid: int) -> None:
        st = self.waiting.pop(rid, None)
        if st is not None:
            self._free(st)
        if rid in self.active:
            self.inst.engine.abort(str(rid))
            self.active.discard(rid)
