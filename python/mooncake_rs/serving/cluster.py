"""``Cluster``: an embedded disaggregated deployment (prefill and decode instances, a
conductor) behind ``generate`` / ``submit``.

The cluster's router thread owns every request's life: ``submit`` asks the conductor
for a decision (or raises ``Overloaded``); the router asks the decode instance to
reserve slots for the request's blocks and, when the decision fetches a prefix, asks
its holder to pin it; then it sends the prefill instance the request with the fetch
source and the destination slots. Prefill streams KV into those slots layer by layer
and reports ``prefilled`` with the first token; the router then starts the decode
instance, whose tokens it forwards to the request's handle. Store events go to the
conductor's index, progress to its load model.

Liveness (``processes=True``): workers send heartbeats on their control socket; the
watchdog thread here kills a worker silent for ``heartbeat_timeout_s`` (a stopped or
wedged process), and the router's usual death path then drops it from the conductor and
fails its requests. A request's deadline (``timeout_s``) or ``RequestHandle.cancel``
cancels it on every instance it lives on.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .. import (Conductor, ConductorConfig, DecodeCostModel, PrefillCostModel, PrefixHasher, TransferCostModel,
               TransferRegistry)
from ..errors import InvalidArgument, MooncakeError, Overloaded
from .._core import remove_shm_segments_of
from .control import Msg, QueueChannel, SocketChannel, send_frame
from .handle import RequestHandle, wait_seconds
from .instance import Instance, InstanceSpec
from .limits import Limits
from .liveness import watch
from .metrics import ClusterMetrics, RequestMetrics

__all__ = ["Cluster", "remove_segments_of"]


def remove_segments_of(pid: int) -> None:
    """Unlinks the shared-memory segments a (gone) worker process created: its transfer
    engine's regions and store arena, ``/dev/shm/mooncake_rs.<pid>.<n>``."""
    remove_shm_segments_of(pid)


log = logging.getLogger("mooncake_rs.serving")


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    params: Any
    keys: list[int]
    decision: Any
    handle: RequestHandle
    t_submit: float
    dest: Msg | None = None
    fetch: Msg | None = None
    wait_fetch: bool = False
    dispatched: bool = False
    prefilled: bool = False  # the prefill instance reported every byte sent (it holds nothing more)
    deadline: float | None = None  # time.monotonic() past which the router cancels it
    tokens: list[int] = field(default_factory=list)
    t_last: float = 0.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finished: bool = False


class _Member:
    def __init__(self, spec: InstanceSpec, channel: Any, proc: subprocess.Popen[bytes] | None = None,
                 thread: threading.Thread | None = None) -> None:
        self.spec, self.ch, self.proc, self.thread = spec, channel, proc, thread
        self.ready = threading.Event()
        self.alive = True
        self.arena = ""
        self.error: str | None = None
        self.info: Msg = {}  # the instance's "ready" message (capacities)
        self.down_reason: str | None = None  # set by the watchdog before it kills a hung worker


class Cluster:
    """An embedded cluster: ``prefill`` + ``decode`` instances and a conductor (see docs/serving.md).

    ``model``: a ModelConfig, a preset name or a model directory; every instance builds
    its engine from it with ``seed`` (so a Cluster and an ``Engine(model, seed=seed)``
    hold the same weights). ``processes=True`` runs one worker process per instance with
    store arenas in /dev/shm (KV moves over shared memory) and a control socket each.
    Extra keywords: ``rejection`` ("none", "early", "predictive"), ``prefix_reuse``
    (False: no KV reuse, every prompt computed), ``stream_layers`` (False: KV is sent
    after the whole prefill), ``engine_kwargs`` (passed to each Engine), ``link_bandwidth``
    (bytes/s: emulate a network link between instances, for benchmarks),
    ``heartbeat_timeout_s`` (worker processes: how long a silent worker may go before it
    is declared down, killed and its requests failed; None disables the watchdog).
    """

    def __init__(self, model: Any = "tiny", prefill: int = 2, decode: int = 1, block_size: int = 16,
                 dram_bytes_per_instance: int = 64 << 20, ssd_path: str | None = None, policy: str = "mooncake",
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 1.0, processes: bool = False, seed: int = 0, *,
                 rejection: str = "none", prefix_reuse: bool = True, stream_layers: bool = True,
                 engine_kwargs: dict[str, Any] | None = None, start_timeout_s: float = 180.0,
                 link_bandwidth: float | None = None, ssd_bytes_per_instance: int | None = None,
                 heartbeat_timeout_s: float | None = 10.0) -> None:
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
        self.seed = seed
        self._model = model
        self._hasher = PrefixHasher(block_size, seed=0)
        self._ids = itertools.count(1)
        self._t0 = time.monotonic()
        self._events: queue.Queue[tuple[int, Msg]] = queue.Queue()
        self._reqs: dict[int, _Req] = {}
        self._lock = threading.Lock()
        self._measured: queue.Queue[Msg] = queue.Queue()
        self.metrics = ClusterMetrics()
        self._closed = False
        self._stop_watch = threading.Event()
        self._token = uuid.uuid4().hex[:8]
        self._transfer_token = secrets.token_hex(32)  # the workers' transfer engines share it
        self._registry = TransferRegistry()  # in-process: how the instances' engines find each other
        self._members: dict[int, _Member] = {}
        self._cfg_args: dict[str, Any] = dict(block_size=block_size, ttft_slo_s=float(ttft_slo_s), tbt_slo_s=float(tbt_slo_s),
                              policy=policy, rejection=rejection, seed=seed)
        self.prefill_ids = list(range(prefill))
        self.decode_ids = list(range(prefill, prefill + decode))
        self._layout_bytes = self._block_bytes(model, block_size)
        self._heartbeat_timeout_s = None if heartbeat_timeout_s is None or not self.processes else float(heartbeat_timeout_s)
        self._limits = Limits(self._model_config(model), block_size)  # instance capacities, once all are ready
        self.conductor = self._new_conductor(PrefillCostModel(c0=0.002, c_new=2e-5, c_new2=0.0, c_cross=0.0))
        self._router = threading.Thread(target=self._route, name="mooncake-router", daemon=True)
        self._router.start()
        try:
            for i in self.prefill_ids + self.decode_ids:
                role = "prefill" if i in self.prefill_ids else "decode"
                name = f"{role}-{i if role == 'prefill' else i - prefill}"
                spec = InstanceSpec(i, role, name, model, block_size, int(dram_bytes_per_instance), seed,
                                    stream_layers, link_bandwidth, dict(engine_kwargs or {}),
                                    ssd_path=None if ssd_path is None else os.path.join(ssd_path, name),
                                    ssd_bytes=ssd_bytes,
                                    # a few beats per timeout, so one late beat is no false alarm
                                    heartbeat_s=(self._heartbeat_timeout_s or 0.0) / 4)
                self._spawn(spec)
            deadline = time.monotonic() + start_timeout_s
            for m in self._members.values():
                if not m.ready.wait(max(0.0, deadline - time.monotonic())) or m.error:
                    raise MooncakeError(f"instance {m.spec.name} did not start: {m.error or 'timeout'}")
            self._limits.learn([m.info for m in self._members.values()])
        except BaseException:
            self.close()
            raise
        if self._heartbeat_timeout_s is not None:
            threading.Thread(target=watch, args=(self, self._heartbeat_timeout_s), name="mooncake-watchdog",
                             daemon=True).start()

    # ---- construction
    @staticmethod
    def _model_config(model: Any) -> Any:
        from ..engine.config import ModelConfig

        if isinstance(model, ModelConfig):
            return model
        if isinstance(model, (str, Path)) and Path(model).is_dir():
            import json

            return ModelConfig.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
        return ModelConfig.preset(str(model))

    @classmethod
    def _block_bytes(cls, model: Any, block_size: int) -> int:
        from ..engine.layout import BlockLayout

        return BlockLayout.for_model(cls._model_config(model), block_size, "float32").block_nbytes

    def _new_conductor(self, prefill_model: Any, index: Any = None) -> Conductor:
        per_token = self._layout_bytes / self.block_size
        cfg = ConductorConfig(
            **self._cfg_args, prefill_model=prefill_model,
            transfer_model=TransferCostModel(bytes_per_token=per_token, network_bandwidth=2e9, latency_s=1e-4),
            decode_model=DecodeCostModel(base_s=0.004, per_seq_s=2e-4, per_token_s=1e-7),
            default_output_len=32)
        c = Conductor(cfg, index)
        for i in self.prefill_ids:
            c.add_prefill(i)
        for i in self.decode_ids:
            c.add_decode(i)
        return c

    def _spawn(self, spec: InstanceSpec) -> None:
        if not self.processes:
            ch = QueueChannel(spec.id, self._events)
            m = _Member(spec, ch)
            self._members[spec.id] = m

            def run() -> None:
                try:
                    Instance(spec, ch, self._registry).run()
                except BaseException as e:  # noqa: BLE001 - reported to the router
                    log.exception("instance %s crashed", spec.name)
                    self._events.put((spec.id, {"op": "dead", "error": f"{type(e).__name__}: {e}"}))

            m.thread = threading.Thread(target=run, name=f"mooncake-{spec.name}", daemon=True)
            m.thread.start()
            return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs.serving.worker", "--fd", str(child.fileno())],
                                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        # The token travels on the private socketpair, never on a command line or in
        # the environment, where other local users could read it.
        send_frame(parent, {"op": "init", "spec": spec, "auth_token": self._transfer_token})
        self._members[spec.id] = _Member(spec, SocketChannel(parent, spec.id, self._events), proc=proc)

    # ---- the public API
    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def instances(self) -> dict[int, str]:
        """Live instances: id -> name."""
        return {i: m.spec.name for i, m in self._members.items() if m.alive}

    def pid_of(self, instance: int) -> int | None:
        """The worker process id of an instance (``processes=True``), else None."""
        m = self._members.get(instance)
        return m.proc.pid if m is not None and m.proc is not None else None

    def submit(self, prompt: Sequence[int], params: Any = None, *, timeout_s: float | None = None) -> RequestHandle:
        """Admits one request and returns its handle; raises ``Overloaded`` when rejected
        and ``InvalidArgument`` for a prompt no instance could serve. ``timeout_s``: a
        deadline from now; past it the request is cancelled on every instance and fails
        with ``TransferTimeout`` (None: no deadline)."""
        from ..engine.params import SamplingParams
        from ..engine.tokens import prompt_tokens

        if self._closed:
            raise InvalidArgument("the cluster is closed")
        params = params or SamplingParams()
        toks = prompt_tokens(prompt, params)
        wait = wait_seconds(timeout_s, "timeout_s")
        if wait is not None and wait <= 0:
            raise InvalidArgument(f"timeout_s must be positive (or None for no deadline), got {timeout_s!r}")
        self._limits.check(toks, params)
        keys = self._hasher.hash(toks)
        rid = next(self._ids)
        self.metrics.count("requests")
        try:
            d = self.conductor.schedule(rid, keys if self.prefix_reuse else [], len(toks), self._now(),
                                        expected_output_len=params.max_tokens)
        except Overloaded:
            self.metrics.count("rejected")
            raise
        req = _Req(rid, toks, params, keys, d, RequestHandle(rid, toks, self._cancel), time.monotonic())
        req.deadline = None if wait is None else req.t_submit + wait
        req.metrics.prefill_instance, req.metrics.decode_instance = d.prefill, d.decode
        req.handle.prefill_instance, req.handle.decode_instance = d.prefill, d.decode
        req.metrics.prompt_tokens = len(toks)
        with self._lock:
            self._reqs[rid] = req
        self._events.put((-1, {"op": "new", "rid": rid}))
        return req.handle

    def _cancel(self, rid: int, error: BaseException) -> None:
        """RequestHandle.cancel: the router ends the request everywhere (see Router._fail)."""
        self._events.put((-1, {"op": "cancel_request", "rid": rid, "error": error}))

    def generate(self, prompts: Sequence[Sequence[int]], params: Any = None, *,
                 on_reject: str = "raise", timeout_s: float | None = None) -> list[Any]:
        """Runs the prompts to completion; outputs in order. A rejected prompt raises
        ``Overloaded`` (``on_reject="raise"``) or yields an output with
        ``finish_reason="rejected"`` (``on_reject="report"``). ``timeout_s`` bounds the
        whole call: what has not finished by then is cancelled on the instances and
        ``TransferTimeout`` is raised. Whatever ends the call early (a rejection, a
        timeout, a failed request, KeyboardInterrupt) cancels the requests still running."""
        from ..engine.outputs import RequestOutput
        from ..engine.params import SamplingParams

        wait = wait_seconds(timeout_s, "timeout_s")
        if wait is not None and wait <= 0:
            raise InvalidArgument(f"timeout_s must be positive (or None to wait forever), got {timeout_s!r}")
        if on_reject not in ("raise", "report"):
            raise InvalidArgument("on_reject must be 'raise' or 'report'")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgument("prompts must be a list of token-id lists")
        plist = [params or SamplingParams()] * len(prompts) if params is None or isinstance(params, SamplingParams) \
            else list(params)
        if len(plist) != len(prompts):
            raise InvalidArgument(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        end = None if wait is None else time.monotonic() + wait
        handles: list[RequestHandle | RequestOutput] = []
        try:
            for p, sp in zip(prompts, plist):
                left = None if end is None else max(end - time.monotonic(), 1e-3)
                try:
                    handles.append(self.submit(p, sp, timeout_s=left))
                except Overloaded:
                    if on_reject == "raise":
                        raise
                    handles.append(RequestOutput("rejected", [int(t) for t in p], [], "rejected",
                                                 metrics=RequestMetrics()))
            return [h.result(None if end is None else max(end - time.monotonic(), 0.0))
                    if isinstance(h, RequestHandle) else h for h in handles]
        except BaseException:
            for h in handles:
                if isinstance(h, RequestHandle):
                    h.cancel()
            raise

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
        return self.metrics.prometheus(gauges)

    def instance_stats(self, timeout_s: float = 30.0) -> dict[int, dict[str, float]]:
        """Per live instance: bytes its transfer engine moved (``copied_bytes``), seconds its
        transfers were in flight (``copy_busy_s``), blocks held, evictions. Call it idle."""
        out = {}
        for i, m in self._members.items():
            if not m.alive:
                continue
            m.ch.to_instance({"op": "stats"})
            try:
                out[i] = self._measured.get(timeout=timeout_s)["stats"]
            except (queue.Empty, KeyError):
                raise MooncakeError(f"instance {m.spec.name} did not report its stats") from None
        return out

    def calibrate(self, points: Sequence[tuple[int, int]] | None = None, *, repeats: int = 3,
                  timeout_s: float = 300.0) -> Any:
        """Measures real prefill times on a prefill instance (``(new, cached)`` token
        points) and refits the conductor's prefill cost model; returns the fitted model.
        Run it while the cluster is idle."""
        with self._lock:
            if any(not r.finished for r in self._reqs.values()):
                raise InvalidArgument("calibrate() needs an idle cluster")
        if points is None:
            b = self.block_size
            points = [(n * b, c * b) for n in (1, 2, 4, 8, 16) for c in (0, 4, 16)]
        inst = next((i for i in self.prefill_ids if self._members[i].alive), None)
        if inst is None:
            raise MooncakeError("no live prefill instance to calibrate on")
        self._members[inst].ch.to_instance({"op": "measure", "points": list(points), "repeats": repeats})
        try:
            msg = self._measured.get(timeout=timeout_s)
        except queue.Empty:
            raise MooncakeError(f"calibration did not finish within {timeout_s}s") from None
        if "error" in msg:
            raise MooncakeError(f"calibration failed: {msg['error']}")
        samples = [(new + cached, cached, s) for new, cached, s in msg["timings"]]
        model = PrefillCostModel.fit(samples)
        fresh = self._new_conductor(model, index=self.conductor.index)
        for i in self.prefill_ids + self.decode_ids:
            if not self._members[i].alive:
                fresh.remove_instance(i)
        self.conductor = fresh
        self.calibration = samples
        return model

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops every instance (worker processes exit), fails what is in flight and
        removes every shared-memory segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch.set()
        for m in self._members.values():
            if m.alive:
                m.ch.to_instance({"op": "stop"})
        deadline = time.monotonic() + timeout_s
        for m in self._members.values():
            if m.thread is not None:
                m.thread.join(max(0.1, deadline - time.monotonic()))
            if m.proc is not None:
                try:
                    m.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(5)
                m.ch.close()
        self._events.put((-1, {"op": "shutdown"}))
        self._router.join(5)
        with self._lock:
            reqs = list(self._reqs.values())
            self._reqs.clear()
        for r in reqs:
            r.handle._fail(MooncakeError("the cluster was closed"))
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

    # ---- the router
    def _route(self) -> None:
        from .router import Router

        Router(self).run()
