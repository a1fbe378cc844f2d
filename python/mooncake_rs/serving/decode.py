"""Decode behaviour of an instance.

``Expect`` (from the cluster): reserve a store slot for each of the request's full
prompt blocks that this instance does not hold yet, plus one request-scoped slot for
the partial last block, and hand the request with those slots straight to its prefill
instance (``Prefill`` on the peer link; the prefill writes into the slots, layer by
layer). ``KvReady`` (from that prefill instance): every byte is in; commit the keyed
slots, send the first token (with the prefill's report) to the cluster, hand all the
blocks to ``Engine.add_decode_request`` (the request joins the continuous batch) and
stream the tokens of each step back. The prompt and the sampling parameters come once,
in ``Expect``; the cluster sees none of the slot offsets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .._core import BlockHashes
from ..base.params import SamplingParams
from ..errors import MooncakeError, StoreFull
from .protocol import (Cancel, Dest, Expect, Failed, InstanceSpec, KvReady, Message, Prefill, ProtocolError,
                       Step, Tokens, op_of)
from .role import RoleContext

__all__ = ["DecodeRole"]

#: kv_grants: how long a request without a deadline may keep its slots' grants (they are
#: revoked when the request ends; this only bounds a grant whose revoke never comes)
GRANT_BOUND_S = 3600.0


@dataclass
class _DState:
    keys: BlockHashes  # every full prompt block's hash (a buffer, no int per block)
    prompt: list[int]
    params: SamplingParams
    prefill: int
    have: dict[int, Any] = field(default_factory=dict)  # block -> Block already held (leased)
    reserved: dict[int, Any] = field(default_factory=dict)  # block -> WritableBlock being filled
    partial: Any = None  # WritableBlock of the partial last block (request-scoped)
    grantee: str = ""  # kv_grants: the prefill engine the slots are granted to
    grants: list[int] = field(default_factory=list)  # kv_grants: the live grant ids


class DecodeRole:
    """A decode instance's behaviour (role.Role)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.engine, self.store, self.endpoint = ctx.engine, ctx.store, ctx.endpoint
        self.transport = ctx.transport
        self.up = ctx.up  # to the cluster
        self.peers = ctx.peers  # prefill instance id -> link
        self.waiting: dict[int, _DState] = {}
        self.active: set[int] = set()
        self._out: list[Tokens] = []  # sent together by send_pending (one frame per loop phase)

    @property
    def spec(self) -> InstanceSpec:
        return self.ctx.spec

    def busy(self) -> bool:
        return False

    def tracked(self) -> int:
        """Requests this role still holds state (reserved slots, a running sequence) for."""
        return len(self.waiting) + len(self.active)

    def rids(self) -> list[int]:
        """The requests ``tracked`` counts."""
        return [*self.waiting, *self.active]

    def holds(self, rid: int) -> bool:
        return rid in self.waiting or rid in self.active

    def handle(self, src: int, msg: Message) -> None:
        match msg:
            case Expect():
                self._expect(msg)
            case KvReady():
                st = self.waiting.get(msg.rid)
                if st is not None and st.prefill != src:
                    raise ProtocolError(f"KvReady for request {msg.rid} from instance {src}, not its prefill "
                                        f"{st.prefill}")
                self._kv_ready(msg)
            case Cancel(rid=rid):
                self._cancel(rid)
            case _:
                raise ProtocolError(f"a decode instance does not take {op_of(msg)}")

    def _expect(self, msg: Expect) -> None:
        store = self.store
        rid = msg.rid
        st = _DState(BlockHashes(msg.keys), msg.prompt, msg.params, msg.prefill)
        self.waiting[rid] = st
        try:
            for i, k in enumerate(st.keys):
                s = store.lookup(k)
                if s is not None:
                    st.have[i] = s
                else:
                    st.reserved[i] = store.reserve(k)
            if len(msg.prompt) % self.spec.block_size:
                st.partial = store.reserve_scratch(rid)
        except StoreFull as e:
            self._cancel(rid)
            self.up(Failed(rid, f"StoreFull: {e}"))
            return
        link = self.peers.get(msg.prefill)
        if link is None or not link.alive:
            self._cancel(rid)
            self.up(Failed(rid, f"prefill instance {msg.prefill} is not reachable"))
            return
        blocks = [None if i in st.have else store.offset(st.reserved[i]) for i in range(len(st.keys))]
        dest = Dest(self.endpoint, blocks, None if st.partial is None else store.offset(st.partial))
        if self.spec.kv_grants:
            try:
                self._grant(st, msg, [o for o in blocks if o is not None] +
                            ([] if dest.partial is None else [dest.partial]))
            except Exception as e:  # noqa: BLE001 - a bad name or range fails this request only
                self._cancel(rid)
                self.up(Failed(rid, f"{type(e).__name__}: {e}"))
                return
        link.send(Prefill(rid, msg.prompt, msg.params, msg.keys, msg.local, msg.fetch, dest, self.spec.id,
                          fetch_also=msg.fetch_also, fetch_split=msg.fetch_split, prefetch=msg.prefetch))

    def _grant(self, st: _DState, msg: Expect, offsets: list[int]) -> None:
        """Lets the request's prefill write exactly its reserved slots (one grant a slot:
        a write never spans two), until its deadline (else ``GRANT_BOUND_S``); the grants
        go when the slots are freed (KV in, cancelled, failed)."""
        if not msg.prefill_name:
            raise ProtocolError(f"Expect for request {msg.rid} names no prefill engine to grant its slots to")
        left = GRANT_BOUND_S if msg.deadline is None else max(msg.deadline - time.monotonic(), 1e-3)
        st.grantee = msg.prefill_name
        nbytes = self.store.block_bytes
        for off in offsets:
            st.grants.append(self.transport.grant(st.grantee, off, nbytes, left))

    def _kv_ready(self, msg: KvReady) -> None:
        rid = msg.rid
        st = self.waiting.pop(rid, None)
        if st is None:
            return  # cancelled meanwhile
        first = [] if msg.first is None else [msg.first]
        if msg.finish != "prefill":  # the first token ended it: nothing to decode
            self._free(st)
            self._out.append(Tokens(rid, first, msg.finish, msg.report))
            return
        store = self.store
        try:
            blocks = []
            for i, k in enumerate(st.keys):
                b = st.have[i] if i in st.have else store.commit(st.reserved.pop(i), lease=True)
                if b is None:
                    raise MooncakeError(f"block {i} was evicted before decode started; raise dram_bytes_per_instance")
                blocks.append(b)
                st.have[i] = b
            # the first token, as soon as the KV is in (sent before the next engine step)
            self._out.append(Tokens(rid, first, None, msg.report))
            views = [store.view(b) for b in blocks]
            if st.partial is not None:
                views.append(store.view(st.partial))
            self.engine.add_decode_request(st.prompt, msg.first, st.params,
                                           views, request_id=str(rid))
            del views  # the engine copied the KV into its pages
        finally:
            self._free(st)
        self.active.add(rid)

    def on_outputs(self, outs: list[Any]) -> None:
        for out in outs:
            rid = int(out.request_id)
            if rid not in self.active:
                continue
            if out.error is not None:  # the engine failed this request alone
                self.active.discard(rid)
                self.up(Failed(rid, out.error))
                continue
            self._out.append(Tokens(rid, list(out.new_token_ids), out.finish_reason))
            if out.finished:
                self.active.discard(rid)

    def send_pending(self) -> None:
        """The tokens of this loop phase (the messages just handled, or one engine step),
        as one message: a ``Step`` when there are several."""
        out, self._out = self._out, []
        if len(out) == 1:
            self.up(out[0])
        elif out:
            self.up(Step(out))

    def poll(self) -> None:
        pass

    def _free(self, st: _DState) -> None:
        for gid in st.grants:  # first: nobody may write the slots once they are freed
            self.transport.revoke(st.grantee, gid)
        st.grants = []
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
            self.engine.abort(str(rid))
            self.active.discard(rid)
