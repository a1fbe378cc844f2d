"""The scheduler side of ``MooncakeRsConnector``: which prompt blocks a request can load
from a KV pool, which it must save, and the pool's blocks as vLLM KV events.

Keys are our chained 128-bit block hashes (:class:`~mooncake_rs.PrefixHasher`, the Rust
core) over the prompt's full blocks, salted with the model id, the request's
``cache_salt`` and its LoRA adapter: two tenants' equal prompts never share a key, so a
pool never serves one tenant's KV to another.

Where blocks are: a :class:`~mooncake_rs.BlockIndex` fed by the followed pools' store
events (pool/follower.py) names the pool holding the longest prefix; the local pool is always
asked directly too (it is one round trip and never stale), and a P/D decode request's
``kv_transfer_params`` name the prefill's pool. Whatever is planned is leased at that pool
(``Lookup`` with a lease), so it cannot be evicted before the worker has copied it; the
lease goes in ``request_finished``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._core import BlockHashes, PrefixHasher
from ...errors import MooncakeError
from ..pool.client import PoolClient
from .config import ConnectorSettings
from .metadata import LoadSpec, MooncakeRsConnectorMetadata, SaveSpec
from ..pool.follower import PoolFollower
from .pools import VllmPoolEvents

if TYPE_CHECKING:
    from .pool_store import PoolBlocks

__all__ = ["ConnectorScheduler"]

log = logging.getLogger("mooncake_rs.vllm")

#: what the prefill's response carries and the decode's request brings back
PARAM_POOL = "mooncake_pool"
PARAM_BLOCKS = "mooncake_blocks"
#: a LoadSpec's pool with store "pool": the cluster-wide pool
POOL = "pool"


@dataclass
class _Load:
    pool: str
    start: int  # first block to load (the local hit ends here)
    end: int  # one past the last
    offsets: list[int]
    checksums: list[int]
    lease: int


@dataclass
class _Req:
    keys: BlockHashes
    prompt_len: int
    pool_held: int  # leading blocks the local pool held when planned
    remote_decode: bool
    vllm_hashes: list[Any]
    lora: Any
    tokens: list[int]
    load: _Load | None = None
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, block_size: int, blocks: PoolBlocks | None = None) -> None:
        """``blocks``: with ``settings.store == "pool"``, the pool to use (default: opened
        from the settings)."""
        self.settings = settings
        self.block_size = block_size
        self._hashers: dict[tuple[str, str], PrefixHasher] = {}
        self._clients: dict[str, PoolClient] = {}
        self._reqs: dict[str, _Req] = {}
        self.events = VllmPoolEvents()
        # store "pool": the cluster-wide pool answers every lookup itself (no leases, no
        # events to follow: pool_store.py); else this host's KV pool and its peers
        self.blocks: PoolBlocks | None = None
        self.follower: PoolFollower | None = None
        if settings.uses_pool:
            from .pool_store import PoolBlocks

            self.blocks = blocks if blocks is not None else PoolBlocks.open(settings)
        else:
            self.follower = PoolFollower(settings.pool, self._client, peers=settings.peers, etcd=settings.etcd,
                                         etcd_prefix=settings.etcd_prefix, on_local_events=self.events.on_local_events)
        self.counters = {"lookups": 0, "tokens_planned": 0, "pool_errors": 0}

    def _client(self, address: str) -> PoolClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = PoolClient(address, self.settings.auth_token, self.settings.timeout_s)
        return c

    def _hasher(self, salt: str, lora: str) -> PrefixHasher:
        h = self._hashers.get((salt, lora))
        if h is None:
            # One tenant's key space per (salt, adapter): the extra bytes go into every hash.
            extra = b"\x00".join(x.encode() for x in (self.settings.model_id, salt, lora))
            h = self._hashers[(salt, lora)] = PrefixHasher(block_size=self.block_size, seed=0, extra=extra)
        return h

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            lora = request.lora_request
            salt = getattr(request, "cache_salt", None) or ""
            keys = self._hasher(salt, lora.name if lora else "").hash_blocks(tokens)
            params = request.kv_transfer_params or {}
            st = self._reqs[request.request_id] = _Req(keys, len(tokens), 0, bool(params.get("do_remote_decode")),
                                                       list(getattr(request, "block_hashes", []) or []), lora, tokens)
        return st

    # --- planning loads -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        self._drop_load(st)
        if not self.settings.loads and not self.settings.saves:
            return 0, False
        keys = st.keys
        params = request.kv_transfer_params or {}
        if self.blocks is not None:
            return self._plan_from_pool(request, st, num_computed_tokens)
        try:
            own = self._client(self.settings.pool).lookup(bytes(keys), self.settings.lease_s)
        except MooncakeError as e:
            self.counters["pool_errors"] += 1
            log.warning("MooncakeRsConnector: local pool %s: %s; no loads or saves for %s", self.settings.pool, e,
                        request.request_id)
            st.pool_held = len(keys)  # saves to an unreachable pool would only fail
            return 0, False
        st.pool_held = own.count
        best, found = self.settings.pool, own
        if self.settings.loads:
            for source in self._candidates(keys, params, own.count):
                try:
                    r = self._client(source).lookup(bytes(keys), self.settings.lease_s)
                except MooncakeError as e:
                    self.counters["pool_errors"] += 1
                    log.warning("MooncakeRsConnector: pool %s: %s", source, e)
                    continue
                if r.count > found.count:
                    self._release(best, found.lease)
                    best, found = source, r
                else:
                    self._release(source, r.lease)
        self.counters["lookups"] += 1
        # vLLM computes at least the prompt's last token itself.
        end = min(found.count, (st.prompt_len - 1) // self.block_size) if self.settings.loads else 0
        start = num_computed_tokens // self.block_size
        if end <= start:
            self._release(best, found.lease)
            return 0, False
        st.load = _Load(best, start, end, list(found.offsets), list(found.checksums), found.lease)
        tokens = (end - start) * self.block_size
        self.counters["tokens_planned"] += tokens
        return tokens, False

    def _plan_from_pool(self, request: Any, st: _Req, num_computed_tokens: int) -> tuple[int, bool]:
        """The cluster-wide pool: how many leading blocks it holds (one ``batch_exists``)."""
        assert self.blocks is not None
        try:
            held = self.blocks.leading(st.keys)
        except MooncakeError as e:
            self.counters["pool_errors"] += 1
            log.warning("MooncakeRsConnector: the pool: %s; no loads or saves for %s", e, request.request_id)
            st.pool_held = len(st.keys)  # saves to an unreachable pool would only fail
            return 0, False
        st.pool_held = held
        self.counters["lookups"] += 1
        end = min(held, (st.prompt_len - 1) // self.block_size) if self.settings.loads else 0
        start = num_computed_tokens // self.block_size
        if end <= start:
            return 0, False
        # no lease: a block evicted before the worker reads it fails its read and is recomputed
        st.load = _Load(POOL, start, end, [], [], 0)
        tokens = (end - start) * self.block_size
        self.counters["tokens_planned"] += tokens
        return tokens, False

    def _candidates(self, keys: BlockHashes, params: dict[str, Any], own: int) -> list[str]:
        assert self.follower is not None
        out = []
        named = params.get(PARAM_POOL) if params.get("do_remote_prefill") else None
        if isinstance(named, str) and named != self.settings.pool:
            self.follower.follow(named)
            out.append(named)
        best = self.follower.best_pool(keys)
        if best is not None and best[1] > own and best[0] not in out and best[0] != self.settings.pool:
            out.append(best[0])
        return out

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None:
            return
        if num_external_tokens <= 0:
            self._drop_load(st)
            return
        st.load.end = min(st.load.end, st.load.start + num_external_tokens // self.block_size)

    # --- the step's plan ------------------------------------------------------------

    def build_connector_meta(self, so: Any) -> MooncakeRsConnectorMetadata:
        meta = MooncakeRsConnectorMetadata()
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if st.load is not None and st.load.end > st.load.start:
                ld = st.load
                meta.loads.append(LoadSpec(new.req_id, ld.pool, st.block_ids[ld.start:ld.end],
                                           ld.offsets[ld.start:ld.end], ld.checksums[ld.start:ld.end],
                                           bytes(st.keys[ld.start:ld.end])))
                st.load.start = st.load.end  # planned once; the lease stays until the request ends
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _plan_save(self, meta: MooncakeRsConnectorMetadata, req_id: str, st: _Req, computed_after: int) -> None:
        if not self.settings.saves:
            return
        end = min(min(computed_after, st.prompt_len) // self.block_size, len(st.block_ids), len(st.keys))
        start = max(st.saved_upto, st.pool_held)
        if end <= start:
            return
        meta.saves.append(SaveSpec(req_id, st.block_ids[start:end], bytes(st.keys[start:end])))
        for i in range(start, end) if self.follower is not None else ():  # the pool mode has no events
            self.events.expect(st.keys[i], self._event_fields(st, i))
        st.saved_upto = end

    def _event_fields(self, st: _Req, i: int) -> dict[str, Any] | None:
        """What a vLLM BlockStored for block ``i`` of this request says (its own hashes)."""
        if i >= len(st.vllm_hashes):
            return None
        return {"hash": st.vllm_hashes[i], "parent": st.vllm_hashes[i - 1] if i else None,
                "tokens": st.tokens[i * self.block_size:(i + 1) * self.block_size], "lora": st.lora}

    # --- the end of a request -------------------------------------------------------

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._drop_load(st)
        if not st.remote_decode:
            return False, None
        # The prefill of a P/D pair: its blocks were committed to the pool at the end of
        # the step that computed them (wait_for_save), before this request could finish.
        return False, {"do_remote_prefill": True, "do_remote_decode": False, PARAM_POOL: self.settings.advertise,
                       PARAM_BLOCKS: max(st.saved_upto, st.pool_held)}

    def _drop_load(self, st: _Req) -> None:
        if st.load is not None:
            self._release(st.load.pool, st.load.lease)
            st.load = None

    def _release(self, pool: str, lease: int) -> None:
        if not lease:
            return
        try:
            self._client(pool).release(lease)
        except MooncakeError as e:  # the lease expires by itself
            log.info("MooncakeRsConnector: releasing a lease at %s: %s", pool, e)

    def take_events(self) -> list[Any]:
        if self.follower is None:  # the cluster-wide pool has no store events to publish
            return []
        self.follower.poll(force=self.events.pending)
        return self.events.take()

    def shutdown(self) -> None:
        for c in self._clients.values():
            c.close()
        if self.blocks is not None:
            self.blocks.close()
