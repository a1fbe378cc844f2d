"""``Cluster``: an embedded disaggregated deployment (prefill and decode instances, a
conductor) behind ``generate`` / ``submit``.

``submit`` asks the conductor for a decision (or raises ``Overloaded``) and hands the
request to the router thread (router.py), which drives its life (lifecycle.py): when
the decision fetches a prefix, the holder pins it first; then the decode instance gets
``Expect``, reserves slots and hands the request straight to the prefill instance,
which streams KV into those slots layer by layer and tells the decode instance when
all of it is in; the decode instance sends the tokens, which the router forwards to the
request's handle. Store events go to the conductor's index, progress to its load model.
The router sees the cluster only through the routed core's port (routed.py); the
instances come and go through ``SpawnedInstances`` (members.py).

Liveness: workers send heartbeats on their control socket, in-process instances beat
from their loop; the watchdog thread here kills a worker silent for
``heartbeat_timeout_s`` (a stopped or wedged process) or marks a silent in-process
instance down (a thread cannot be killed), and the router's usual death path then drops
it from the conductor and fails its requests. The beats carry each instance's KV and
store use: ``kv_usage`` and the gauges of ``metrics_text``. A request's deadline
(``timeout_s``) or ``RequestHandle.cancel`` cancels it on every instance it lives on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from .._core import Conductor, PrefillCostModel, TransferRegistry
from ..client.remote import RemoteCluster
from ..errors import InvalidArgument, MooncakeError
from .config import ServingConfig
from .kv_events import endpoints_for
from .limits import Limits
from .members import Members, SpawnedInstances, remove_segments_of, spawn_all
from .protocol import Failed, InstanceSpec, Measure, Stop, Timings
from .routed import RoutedApi, RoutedCluster, default_prefill_model, new_conductor

__all__ = ["Cluster", "remove_segments_of"]


log = logging.getLogger("mooncake_rs.serving")


def _kv_events_of(eps: tuple[str, str] | None) -> dict[str, Any]:
    return {} if eps is None else {"kv_events": eps[0], "kv_events_replay": eps[1]}


class Cluster(RoutedApi):
    """An embedded cluster: ``prefill`` + ``decode`` instances and a conductor (see docs/serving.md).

    ``model``: a ModelConfig, a preset name or a model directory; every instance builds
    its engine from it with ``seed`` (so a Cluster and an ``Engine(model, seed=seed)``
    hold the same weights). ``processes=True`` runs one worker process per instance with
    store arenas in /dev/shm (KV moves over shared memory) and a control socket each.
    Extra keywords: ``rejection`` ("none", "early", "predictive"), ``prefix_reuse``
    (False: no KV reuse, every prompt computed), ``stream_layers`` (False: KV is sent
    after the whole prefill), ``engine_kwargs`` (passed to each Engine), ``link_bandwidth``
    (bytes/s: emulate a network link between instances, for benchmarks),
    ``heartbeat_timeout_s`` (how long a silent instance may go before it is declared
    down and its requests failed: a worker process is killed, an in-process instance
    whose loop stopped turning is marked down and fenced, see liveness.py; None
    disables the watchdog), ``kv_events`` (publish each prefill instance's store events in
    the vLLM/SGLang ZMQ format: ``"tcp://HOST:PORT"``, the i-th prefill instance on PORT + 2i
    and its replay on PORT + 2i + 1, or ``{instance name: "tcp://HOST:PORT"}``; see
    ``kv_event_endpoints`` and serving/kv_events.py). ``kv_grants`` (True): each decode
    arena is registered ``restricted`` and a request's prefill may write only its reserved
    slots, while the request lasts (a transfer grant, revoked when the KV is in or the
    request ends); with ``processes=True`` every worker also gets its own transfer token,
    so no worker can pass for another. Costs the shm fast path: KV between workers goes
    over TCP. ``multipath`` (True): a prefix fetch reads from every prefill instance that
    holds the prefix at once, each sending a share split by its free bandwidth
    (serving/multisource.py, DualPath's multi-path loading); ``RequestMetrics.fetch_sources``
    says how many it read from. Off: from the one holder the conductor names.
    ``replicate_every_s``: act on the conductor's hot-prefix replica hints that often (a
    prefix whose holders are all busy, by queue or by their link out, is copied from one
    of them to an idle prefill instance; serving/replication.py), at most
    ``replica_max_bytes`` of KV per round and in flight; ``replicate_hot_prefixes()`` runs
    one round now.
    """

    def __init__(self, model: Any = "tiny", prefill: int = 2, decode: int = 1, block_size: int = 16,
                 dram_bytes_per_instance: int = 64 << 20, ssd_path: str | None = None, policy: str = "mooncake",
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 1.0, processes: bool = False, seed: int = 0, *,
                 rejection: str = "none", prefix_reuse: bool = True, stream_layers: bool = True,
                 engine_kwargs: dict[str, Any] | None = None, start_timeout_s: float = 180.0,
                 link_bandwidth: float | None = None, ssd_bytes_per_instance: int | None = None,
                 heartbeat_timeout_s: float | None = 10.0, kv_events: str | dict[str, str] | None = None,
                 kv_grants: bool = False, multipath: bool = False, replicate_every_s: float | None = None,
                 replica_max_bytes: float = 64e9) -> None:
        self._start(model, ServingConfig(
            policy=policy, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, rejection=rejection, prefix_reuse=prefix_reuse,
            multipath=multipath, seed=seed, heartbeat_timeout_s=heartbeat_timeout_s, block_size=block_size,
            prefill=prefill, decode=decode, dram_bytes_per_instance=dram_bytes_per_instance, ssd_path=ssd_path,
            ssd_bytes_per_instance=ssd_bytes_per_instance, processes=processes, stream_layers=stream_layers,
            engine_kwargs=engine_kwargs or {}, link_bandwidth=link_bandwidth, kv_events=kv_events,
            kv_grants=kv_grants, start_timeout_s=start_timeout_s, replicate_every_s=replicate_every_s,
            replica_max_bytes=replica_max_bytes))

    @classmethod
    def from_config(cls, model: Any, config: ServingConfig) -> "Cluster":
        """A cluster of ``model`` as ``config`` says (``ServingConfig.from_args`` for a
        command line's)."""
        self = cls.__new__(cls)
        self._start(model, config)
        return self

    def _start(self, model: Any, cfg: ServingConfig) -> None:
        if cfg.ssd_path is not None:
            # Each instance's store gets its own SSD tier under ssd_path/<instance name>.
            os.makedirs(cfg.ssd_path, exist_ok=True)
        self.processes = cfg.processes
        self.seed = cfg.seed
        self.kv_grants = cfg.kv_grants
        self._model = model
        self._transfer_token = secrets.token_hex(32)  # the workers' transfer engines share it
        self._registry = TransferRegistry()  # in-process: how the instances' engines find each other
        self._prefill_model = default_prefill_model()
        self._decode_capacity: tuple[int, int] | None = None  # (batch, KV tokens), once the instances said
        self._layout_bytes = 0  # the instances' block bytes (their engines' dtype), once they said
        prefill_ids = list(range(cfg.prefill))
        decode_ids = list(range(cfg.prefill, cfg.prefill + cfg.decode))
        names = {i: f"prefill-{i}" for i in prefill_ids} | {i: f"decode-{i - cfg.prefill}" for i in decode_ids}
        members = Members()
        #: the routed core this cluster feeds with its spawned instances (routed.py)
        self._core = core = RoutedCluster(cfg, members, SpawnedInstances(members, lambda: core.closed),
                                          block_size=cfg.block_size,
                                          limits=Limits(self._model_config(model), cfg.block_size), names=names)
        #: prefill instance name -> (PUB, replay ROUTER) of its KV events (serving/kv_events.py)
        self.kv_event_endpoints = endpoints_for(cfg.kv_events, [names[i] for i in prefill_ids])
        # in-process instances beat from their loop (liveness.py); workers from a thread
        beat_s = (cfg.heartbeat_timeout_s or 0.0) / 4  # a few beats per timeout: one late beat is no false alarm
        try:
            wire_model = self._wire_model(model)
            specs = [InstanceSpec(i, "prefill" if i in prefill_ids else "decode", names[i], wire_model,
                                  cfg.block_size, cfg.dram_bytes_per_instance, cfg.seed, cfg.stream_layers,
                                  cfg.link_bandwidth, dict(cfg.engine_kwargs),
                                  ssd_path=None if cfg.ssd_path is None else os.path.join(cfg.ssd_path, names[i]),
                                  ssd_bytes=cfg.ssd_bytes, heartbeat_s=beat_s, kv_grants=cfg.kv_grants,
                                  **_kv_events_of(self.kv_event_endpoints.get(names[i])))
                     for i in prefill_ids + decode_ids]
            # kv_grants across processes: a token of its own (sent privately in Init) for
            # each instance that connects out, the prefills; a decode instance only serves
            # (the cluster token authenticates unlisted names there, which hold no grant)
            self._instance_tokens = {i: secrets.token_hex(32) for i in prefill_ids} \
                if cfg.kv_grants and cfg.processes else {}
            if cfg.processes:  # segments of an earlier cluster whose process was killed
                from .shm import clean_at_exit, sweep_dead

                sweep_dead()
                clean_at_exit()
            # filled in place, before any instance starts: a fast one's Ready may reach the
            # router before spawn_all returns
            spawn_all(specs, cfg.processes, self._core.router.events, self._registry, self._transfer_token,
                      self._instance_tokens, members=members)
            deadline = time.monotonic() + cfg.start_timeout_s
            for m in members.values():
                if not m.ready.wait(max(0.0, deadline - time.monotonic())) or m.error:
                    raise MooncakeError(f"instance {m.spec.name} did not start: {m.error or 'timeout'}")
            ready = members.ready_infos()
            self._core.limits.learn(ready)
            # The conductor, now that the instances said what they hold: its transfer cost
            # on their real block bytes (a bfloat16 engine's blocks are half a float32's),
            # and admission filling a decode instance to what its engine holds: its batch
            # (max_num_seqs) and its KV pool, not a default sized for a large GPU.
            self._layout_bytes = max(r.block_bytes for r in ready)
            self._decode_capacity = (int(cfg.engine_kwargs.get("max_num_seqs", 64)),
                                     core.limits.kv_tokens or 1_000_000)
            self._core.swap_conductor(self._new_conductor(self._prefill_model))
        except BaseException:
            self.close()
            raise
        if cfg.heartbeat_timeout_s is not None:
            self._core.start_watchdog(cfg.heartbeat_timeout_s)

    @property
    def prefill_ids(self) -> list[int]:
        """The prefill instances' ids (down ones too); a role switch moves an id."""
        return self._core.members.ids("prefill")

    @property
    def decode_ids(self) -> list[int]:
        """The decode instances' ids (down ones too); a role switch moves an id."""
        return self._core.members.ids("decode")

    # ---- construction
    @staticmethod
    def _model_config(model: Any) -> Any:
        from ..base.model_config import ModelConfig, model_dir_config

        if isinstance(model, ModelConfig):
            return model
        if isinstance(model, (str, Path)) and Path(model).is_dir():
            return model_dir_config(model)
        return ModelConfig.preset(str(model))

    def _new_conductor(self, prefill_model: Any, index: Any = None) -> Conductor:
        return new_conductor(self.config.conductor_args(self.config.block_size), self._layout_bytes, prefill_model,
                             self.prefill_ids, self.decode_ids, index, decode_capacity=self._decode_capacity,
                             link_bandwidth=self.config.link_bandwidth)

    @staticmethod
    def _wire_model(model: Any) -> str | dict[str, Any]:
        """The model as an InstanceSpec carries it: a preset name or directory, or a
        ModelConfig's fields."""
        if isinstance(model, (str, Path)):
            return str(model)
        return dataclasses.asdict(model)

    @staticmethod
    def connect(address: str | None = None, *, etcd: Any = None, auth_token: str, cluster: str = "default",
                connect_timeout_s: float = 10.0) -> RemoteCluster:
        """A running deployment across hosts (``mooncake-rs serve --etcd``), with this
        class's request API: a ``RemoteCluster`` (client/remote.py; also
        ``mooncake_rs.deploy.RemoteCluster``). ``etcd``: find the leading
        ``serve`` there (under ``cluster``; a URL, or a ``deploy.EtcdClient`` for etcd's
        authentication and TLS); or ``address``: a ``serve``'s ``--listen``.
        ``auth_token``: the cluster token. See docs/deploy.md."""
        return RemoteCluster(address, etcd=etcd, auth_token=auth_token, cluster=cluster,
                             connect_timeout_s=connect_timeout_s)

    # ---- the public API (submit, generate, metrics_text, kv_usage: RoutedApi, over the core)
    def pid_of(self, instance: int) -> int | None:
        """The worker process id of an instance (``processes=True``), else None."""
        m = self._core.members.get(instance)
        return m.proc.pid if m is not None and m.proc is not None else None

    def message_counts(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Control messages sent so far on every link of the cluster, by op (``new``:
        requests handed to the router): what docs/serving.md counts as hops. Heartbeats
        and the stats exchange this call makes are left out. Call it idle."""
        total: collections.Counter[str] = collections.Counter({k.lower(): v for k, v in
                                                               self._core.router.counts.snapshot().items()})
        for m in self._core.members.values():
            total.update(m.cluster_counts())
        for st in self.instance_stats(timeout_s).values():
            for k, v in st.items():
                if k.startswith("sent."):
                    total[k[5:]] += int(v)
        for op in ("stats", "stats_reply", "beat"):
            total.pop(op, None)
        return dict(total)

    def calibrate(self, points: Sequence[tuple[int, int]] | None = None, *, repeats: int = 3,
                  timeout_s: float = 300.0) -> Any:
        """Measures real prefill times on a prefill instance (``(new, cached)`` token
        points) and refits the conductor's prefill cost model; returns the fitted model.
        Run it while the cluster is idle."""
        if self._core.router.in_flight():
            raise InvalidArgument("calibrate() needs an idle cluster")
        if points is None:
            b = self.config.block_size
            points = [(n * b, c * b) for n in (1, 2, 4, 8, 16) for c in (0, 4, 16)]
        inst = next((i for i in self.prefill_ids if self._core.members[i].live), None)
        if inst is None:
            raise MooncakeError("no live prefill instance to calibrate on")
        pts = [(int(n), int(c)) for n, c in points]
        msg = self._core.ask(inst, lambda qid: Measure(pts, repeats, qid=qid), timeout_s)
        if msg is None:
            raise MooncakeError(f"calibration did not finish within {timeout_s}s")
        if isinstance(msg, Failed):
            raise MooncakeError(f"calibration failed: {msg.error}")
        if not isinstance(msg, Timings):
            raise MooncakeError(f"calibration got {type(msg).__name__} instead of timings")
        samples = [(new + cached, cached, s) for new, cached, s in msg.timings]
        model = PrefillCostModel.fit(samples)
        self._prefill_model = model
        # swapped on the router thread, which drops the instances it knows are down; never
        # during a role switch (the fresh conductor is built from the pools it ends with)
        with self._core.switch_lock:
            assert self.conductor is not None  # built before the constructor returned
            self._core.swap_conductor(self._new_conductor(model, index=self.conductor.index))
        self.calibration = samples
        return model

    def switch_role(self, instance: int, role: str, *, timeout_s: float = 120.0) -> Any:
        """Moves ``instance`` to the ``role`` pool ("prefill" or "decode") under load,
        failing no request: the conductor drains it, it finishes what it holds, takes the
        new role and comes back (serving/roles.py). Returns a ``roles.RoleSwitch``. Not
        with ``kv_grants``. One switch at a time; ``calibrate`` and ``instance_stats`` may
        run beside it (each call's answer carries its query id)."""
        from .roles import check_role, switch_role

        check_role(role, timeout_s)
        if self._core.closed:
            raise InvalidArgument("the cluster is closed")
        if self.kv_grants:
            raise InvalidArgument("switch_role is not supported with kv_grants=True (a decode arena is restricted and "
                                  "each prefill has its own transfer token, both set up at spawn); start the cluster "
                                  "with the roles it needs instead")
        with self._core.switch_lock:
            return switch_role(self.conductor, self._core.members, self._core.ask, instance, role, timeout_s=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops every instance (worker processes exit), fails what is in flight and
        removes every shared-memory segment. Idempotent."""
        if self._core.closed:
            return
        self._core.closed = True
        self._core.stop_watchdog()
        for m in self._core.members.values():
            if m.alive:
                m.ch.to_instance(Stop())
        deadline = time.monotonic() + timeout_s
        for m in self._core.members.values():
            if m.thread is not None and not (m.down_reason is not None and m.thread.is_alive()):
                # (a thread declared wedged is not waited for: it exits if it ever wakes)
                m.thread.join(max(0.1, deadline - time.monotonic()))
            if m.proc is not None:
                try:
                    m.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(5)
                m.ch.close()
        self._core.stop_routing(MooncakeError("the cluster was closed"), 5.0)
        self._cleanup_shm()

    def _cleanup_shm(self) -> None:
        for m in self._core.members.values():
            if m.proc is not None:
                remove_segments_of(m.proc.pid)

    def __del__(self) -> None:
        try:
            self.close(timeout_s=2.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
