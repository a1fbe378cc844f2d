"""``Cluster``: an embedded disaggregated deployment (prefill and decode instances, a
conductor) behind ``generate`` / ``submit``.

``submit`` asks the conductor for a decision (or raises ``Overloaded``) and hands the
request to the router thread (router.py), which drives its life (lifecycle.py): when
the decision fetches a prefix, the holder pins it first; then the decode instance gets
``Expect``, reserves slots and hands the request straight to the prefill instance,
which streams KV into those slots layer by layer and tells the decode instance when
all of it is in; the decode instance sends the tokens, which the router forwards to the
request's handle. Store events go to the conductor's index, progress to its load model.
The router sees the cluster only through ``_RouterPort``.

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
import math
import os
import queue
import secrets
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from .._core import (Conductor, PrefillCostModel, PrefixHasher, TransferRegistry)
from ..errors import InvalidArgument, MooncakeError
from .kv_events import endpoints_for
from .control import Lost
from .limits import Limits
from .liveness import watch
from .members import Member, mark_down, remove_segments_of, spawn_all
from .protocol import (PROTOCOL_VERSION, Failed, InitFailed, InstanceSpec, Measure, Message, Ready, Stats,
                       StatsReply, Stop, Timings)
from .routed import RoutedCluster, new_conductor, request_output
from .router import RequestRecord, Router, Shutdown, SwapConductor

__all__ = ["Cluster", "remove_segments_of"]


log = logging.getLogger("mooncake_rs.serving")


class _RouterPort:
    """The cluster as the router sees it (router.ClusterPort): these methods and
    attributes, nothing else of the cluster's state."""

    def __init__(self, cluster: "Cluster") -> None:
        self._c = cluster
        self.prefix_reuse = cluster.prefix_reuse
        self.block_size = cluster.block_size
        self.metrics = cluster.metrics

    @property
    def conductor(self) -> Any:
        return self._c.conductor

    @conductor.setter
    def conductor(self, value: Any) -> None:  # SwapConductor, on the router thread
        self._c.conductor = value

    def send(self, inst: int, msg: Message) -> None:
        m = self._c._members.get(inst)
        if m is not None and m.alive:
            m.ch.to_instance(msg)

    def instance_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        m = self._c._members[inst]
        if isinstance(msg, Ready):
            if msg.version != PROTOCOL_VERSION:
                m.error = f"protocol version {msg.version}, the cluster speaks {PROTOCOL_VERSION}"
            m.info = msg
        else:
            m.error = msg.error
        m.ready.set()

    def instance_down(self, inst: int, reason: str) -> str | None:
        return self._c._instance_down(inst, reason)

    def peer_lost(self, inst: int, peer: int, reason: str) -> None:
        c = self._c
        m = c._members.get(peer)
        if c._closed or m is None or not m.alive or m.proc is None or m.proc.poll() is not None:
            return  # closing, or the peer is dead already (its own link says so)
        log.warning("serving: %s lost its link to %s (%s); killing %s", c._members[inst].spec.name, m.spec.name,
                    reason, m.spec.name)
        m.proc.kill()  # its control link then closes: the usual death path

    def exited(self) -> list[int]:
        return [i for i, m in self._c._members.items() if m.alive and m.proc is not None and m.proc.poll() is not None]

    def reply(self, inst: int, msg: Message) -> None:
        self._c._replies.deliver(inst, msg)

    def output(self, record: RequestRecord, reason: str) -> Any:
        return request_output(record, reason)

    def now(self) -> float:
        return self._c._now()


def _kv_events_of(eps: tuple[str, str] | None) -> dict[str, Any]:
    return {} if eps is None else {"kv_events": eps[0], "kv_events_replay": eps[1]}


class Cluster(RoutedCluster):
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
    """

    def __init__(self, model: Any = "tiny", prefill: int = 2, decode: int = 1, block_size: int = 16,
                 dram_bytes_per_instance: int = 64 << 20, ssd_path: str | None = None, policy: str = "mooncake",
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 1.0, processes: bool = False, seed: int = 0, *,
                 rejection: str = "none", prefix_reuse: bool = True, stream_layers: bool = True,
                 engine_kwargs: dict[str, Any] | None = None, start_timeout_s: float = 180.0,
                 link_bandwidth: float | None = None, ssd_bytes_per_instance: int | None = None,
                 heartbeat_timeout_s: float | None = 10.0, kv_events: str | dict[str, str] | None = None,
                 kv_grants: bool = False, multipath: bool = False) -> None:
        if not isinstance(prefill, int) or not isinstance(decode, int) or prefill < 1 or decode < 1:
            raise InvalidArgument("a cluster needs prefill >= 1 and decode >= 1 instances")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgument(f"block_size must be an int >= 1, got {block_size!r}")
        if ssd_bytes_per_instance is not None and (not isinstance(ssd_bytes_per_instance, int) or ssd_bytes_per_instance < 0):
            raise InvalidArgument(f"ssd_bytes_per_instance must be an int >= 0, got {ssd_bytes_per_instance!r}")
        if heartbeat_timeout_s is not None and (
                isinstance(heartbeat_timeout_s, bool) or not isinstance(heartbeat_timeout_s, (int, float))
                or not 0 < heartbeat_timeout_s < math.inf):
            raise InvalidArgument(f"heartbeat_timeout_s must be a positive number of seconds or None, "
                                  f"got {heartbeat_timeout_s!r}")
        if ssd_path is not None:
            # Each instance's store gets its own SSD tier under ssd_path/<instance name>.
            os.makedirs(ssd_path, exist_ok=True)
        ssd_bytes = 0 if ssd_path is None else (
            4 * int(dram_bytes_per_instance) if ssd_bytes_per_instance is None else ssd_bytes_per_instance)
        self.block_size = block_size
        self.processes = bool(processes)
        self.prefix_reuse = bool(prefix_reuse)
        self.multipath = bool(multipath)
        self.seed = seed
        self._model = model
        self._hasher = PrefixHasher(block_size, seed=0)
        self._init_routing()
        self._stop_watch = threading.Event()
        self._token = uuid.uuid4().hex[:8]
        self._transfer_token = secrets.token_hex(32)  # the workers' transfer engines share it
        self.kv_grants = bool(kv_grants)
        self._registry = TransferRegistry()  # in-process: how the instances' engines find each other
        self._members: dict[int, Member] = {}
        self._cfg_args: dict[str, Any] = dict(block_size=block_size, ttft_slo_s=float(ttft_slo_s), tbt_slo_s=float(tbt_slo_s),
                              policy=policy, rejection=rejection, seed=seed)
        self.prefill_ids = list(range(prefill))
        self.decode_ids = list(range(prefill, prefill + decode))
        # until the instances report their real block bytes (the engine's dtype): a float32 estimate
        self._layout_bytes = self._block_bytes(model, block_size)
        # in-process instances beat from their loop (liveness.py); workers from a thread
        self._heartbeat_timeout_s = None if heartbeat_timeout_s is None else float(heartbeat_timeout_s)
        self._limits = Limits(self._model_config(model), block_size)  # instance capacities, once all are ready
        self._engine_kwargs = dict(engine_kwargs or {})
        self._decode_capacity: tuple[int, int] | None = None  # (batch, KV tokens), once the instances said
        self._prefill_model = PrefillCostModel(c0=0.002, c_new=2e-5, c_new2=0.0, c_cross=0.0)
        self._link_bandwidth = link_bandwidth
        self.conductor = self._new_conductor(self._prefill_model)
        names = {i: f"prefill-{i}" for i in self.prefill_ids} | {
            i: f"decode-{i - prefill}" for i in self.decode_ids}
        #: prefill instance name -> (PUB, replay ROUTER) of its KV events (serving/kv_events.py)
        self.kv_event_endpoints = endpoints_for(kv_events, [names[i] for i in self.prefill_ids])
        self._router = Router(_RouterPort(self), names)
        self._router_thread = threading.Thread(target=self._router.run, name="mooncake-router", daemon=True)
        self._router_thread.start()
        try:
            wire_model = self._wire_model(model)
            specs = [InstanceSpec(i, "prefill" if i in self.prefill_ids else "decode", names[i], wire_model, block_size,
                                  int(dram_bytes_per_instance), seed, stream_layers, link_bandwidth,
                                  dict(engine_kwargs or {}),
                                  ssd_path=None if ssd_path is None else os.path.join(ssd_path, names[i]),
                                  ssd_bytes=ssd_bytes,
                                  # a few beats per timeout, so one late beat is no false alarm
                                  heartbeat_s=(self._heartbeat_timeout_s or 0.0) / 4,
                                  kv_grants=self.kv_grants,
                                  **_kv_events_of(self.kv_event_endpoints.get(names[i])))
                     for i in self.prefill_ids + self.decode_ids]
            # kv_grants across processes: a token of its own (sent privately in Init) for
            # each instance that connects out, the prefills; a decode instance only serves
            # (the cluster token authenticates unlisted names there, which hold no grant)
            self._instance_tokens = {i: secrets.token_hex(32) for i in self.prefill_ids} \
                if self.kv_grants and self.processes else {}
            if self.processes:  # segments of an earlier cluster whose process was killed
                from .shm import clean_at_exit, sweep_dead

                sweep_dead()
                clean_at_exit()
            # filled in place, before any instance starts: a fast one's Ready may reach the
            # router before spawn_all returns
            spawn_all(specs, self.processes, self._router.events, self._registry, self._transfer_token,
                      self._instance_tokens, members=self._members)
            deadline = time.monotonic() + start_timeout_s
            for m in self._members.values():
                if not m.ready.wait(max(0.0, deadline - time.monotonic())) or m.error:
                    raise MooncakeError(f"instance {m.spec.name} did not start: {m.error or 'timeout'}")
            ready = [m.info for m in self._members.values() if m.info is not None]
            self._limits.learn(ready)
            # The conductor's transfer cost uses the block bytes the instances report (a
            # bfloat16 engine's blocks are half a float32 estimate). Nothing is routed yet.
            # ... and admission fills a decode instance to what its engine holds: its batch
            # (max_num_seqs) and its KV pool, not a default sized for a large GPU
            self._layout_bytes = max(r.block_bytes for r in ready)
            self._decode_capacity = (int(self._engine_kwargs.get("max_num_seqs", 64)), self._limits.kv_tokens or 1_000_000)
            self._swap_conductor(self._new_conductor(self._prefill_model, index=self.conductor.index))
        except BaseException:
            self.close()
            raise
        if self._heartbeat_timeout_s is not None:
            threading.Thread(target=watch, args=(lambda: list(self._members.values()), self._stop_watch,
                                                 self._heartbeat_timeout_s, self._report_down),
                             name="mooncake-watchdog", daemon=True).start()

    # ---- construction
    @staticmethod
    def _model_config(model: Any) -> Any:
        from ..base.model_config import ModelConfig, model_dir_config

        if isinstance(model, ModelConfig):
            return model
        if isinstance(model, (str, Path)) and Path(model).is_dir():
            return model_dir_config(model)
        return ModelConfig.preset(str(model))

    @classmethod
    def _block_bytes(cls, model: Any, block_size: int) -> int:
        from ..base.layout import BlockLayout

        return BlockLayout.for_model(cls._model_config(model), block_size, "float32").block_nbytes

    def _new_conductor(self, prefill_model: Any, index: Any = None) -> Conductor:
        return new_conductor(self._cfg_args, self._layout_bytes, prefill_model, self.prefill_ids, self.decode_ids,
                             index, decode_capacity=self._decode_capacity, link_bandwidth=self._link_bandwidth)

    @staticmethod
    def _wire_model(model: Any) -> str | dict[str, Any]:
        """The model as an InstanceSpec carries it: a preset name or directory, or a
        ModelConfig's fields."""
        if isinstance(model, (str, Path)):
            return str(model)
        return dataclasses.asdict(model)

    def _swap_conductor(self, fresh: Conductor, timeout_s: float = 30.0) -> None:
        """Replaces the conductor on the router thread (never under a call of its)."""
        done = threading.Event()
        self._router.post(SwapConductor(fresh, done))
        if not done.wait(timeout_s):
            raise MooncakeError("the router did not take the new conductor")

    def _report_down(self, inst: int, reason: str) -> None:
        """The watchdog: an in-process instance stopped beating. The router takes it as
        a closed link (its usual death path)."""
        self._router.events.put((inst, Lost(reason)))

    def _instance_down(self, inst: int, reason: str) -> str | None:
        m = self._members.get(inst)
        if m is None or not m.alive:
            return None
        return mark_down(m, reason, quiet=self._closed)

    @staticmethod
    def connect(address: str | None = None, *, etcd: Any = None, auth_token: str, cluster: str = "default",
                connect_timeout_s: float = 10.0) -> Any:
        """A running deployment across hosts (``mooncake-rs serve --etcd``), with this
        class's request API: a ``deploy.RemoteCluster``. ``etcd``: find the leading
        ``serve`` there (under ``cluster``; a URL, or a ``deploy.EtcdClient`` for etcd's
        authentication and TLS); or ``address``: a ``serve``'s ``--listen``.
        ``auth_token``: the cluster token. See docs/deploy.md."""
        from ..deploy.remote import RemoteCluster

        return RemoteCluster(address, etcd=etcd, auth_token=auth_token, cluster=cluster,
                             connect_timeout_s=connect_timeout_s)

    # ---- the public API (submit, generate, metrics_text, kv_usage: RoutedCluster)
    def pid_of(self, instance: int) -> int | None:
        """The worker process id of an instance (``processes=True``), else None."""
        m = self._members.get(instance)
        return m.proc.pid if m is not None and m.proc is not None else None

    def message_counts(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Control messages sent so far on every link of the cluster, by op (``new``:
        requests handed to the router): what docs/serving.md counts as hops. Heartbeats
        and the stats exchange this call makes are left out. Call it idle."""
        total: collections.Counter[str] = collections.Counter({k.lower(): v for k, v in
                                                               self._router.counts.snapshot().items()})
        for m in self._members.values():
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
        if self._router.in_flight():
            raise InvalidArgument("calibrate() needs an idle cluster")
        if points is None:
            b = self.block_size
            points = [(n * b, c * b) for n in (1, 2, 4, 8, 16) for c in (0, 4, 16)]
        inst = next((i for i in self.prefill_ids if self._members[i].alive), None)
        if inst is None:
            raise MooncakeError("no live prefill instance to calibrate on")
        pts = [(int(n), int(c)) for n, c in points]
        msg = self._ask(inst, lambda qid: Measure(pts, repeats, qid=qid), timeout_s)
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
        with self._switch_lock:
            self._swap_conductor(self._new_conductor(model, index=self.conductor.index))
        self.calibration = samples
        return model

    def switch_role(self, instance: int, role: str, *, timeout_s: float = 120.0) -> Any:
        """Moves ``instance`` to the ``role`` pool ("prefill" or "decode") under load,
        failing no request: the conductor drains it, it finishes what it holds, takes the
        new role and comes back (serving/roles.py). Returns a ``roles.RoleSwitch``. Not
        with ``kv_grants``. One switch at a time; ``calibrate`` and ``instance_stats`` may
        run beside it (each call's answer carries its query id)."""
        from .roles import switch_role

        with self._switch_lock:
            return switch_role(self, instance, role, timeout_s=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops every instance (worker processes exit), fails what is in flight and
        removes every shared-memory segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch.set()
        for m in self._members.values():
            if m.alive:
                m.ch.to_instance(Stop())
        deadline = time.monotonic() + timeout_s
        for m in self._members.values():
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
        self._router.post(Shutdown())
        self._router_thread.join(5)
        if not self._router_thread.is_alive():
            self._router.fail_all(MooncakeError("the cluster was closed"))
        self._cleanup_shm()

    def _cleanup_shm(self) -> None:
        for m in self._members.values():
            if m.proc is not None:
                remove_segments_of(m.proc.pid)

    def __del__(self) -> None:
        try:
            self.close(timeout_s=2.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
