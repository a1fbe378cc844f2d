"""``mooncake-rs worker``: one serving instance (Engine + Store + TransferEngine) on this
host, for a deployment across hosts.

    mooncake-rs worker --role prefill --model tiny --etcd http://10.0.0.1:2379 \\
        --listen 10.0.0.2:7000 --auth-token-file /etc/mooncake/token

It builds its instance first (so what it announces is what it has), listens on
``--listen`` for its conductor (authenticated with the cluster token; the conductor
connects to it), and registers in etcd under a lease it keeps alive: name, role,
control and transfer addresses, the model fingerprint, block bytes and capacity. A
worker whose fingerprint differs from the cluster's is refused there and exits with
the reason (KV of different models never mixes). The transfer engine listens on the
same host (``--transfer-port``, default any) with the same token; ``--transports tcp``
keeps KV off shared memory (hosts that share a kernel, in tests).

It serves until SIGTERM / SIGINT: then it revokes its lease (the conductor drops it at
once), stops its instance and exits 0. A crashed worker's key expires with the lease.
A conductor that goes away leaves the worker running: it drops the requests it held for
it and waits for the next one (a new leader) to attach.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, MooncakeError
from ..client.records import ModelFingerprint, WorkerRecord
from ..client.records import cluster_prefix
from .settings import add_etcd_arguments, etcd_client, read_token, split_hostport

__all__ = ["add_worker_arguments", "run_worker", "fingerprint_of"]

log = logging.getLogger("mooncake_rs.deploy")


def fingerprint_of(engine: Any, model: str, seed: int, block_size: int) -> ModelFingerprint:
    """What must match across the cluster: the model (a random-weight preset's seed is
    part of its identity), its KV layout and the block size."""
    layout = engine.layout
    is_dir = Path(model).is_dir()
    model_id = Path(model).resolve().name if is_dir else f"{model}@seed{seed}"
    return ModelFingerprint(model=model_id, dtype=str(layout.dtype), num_layers=int(layout.num_layers),
                            num_kv_heads=int(layout.num_kv_heads), head_dim=int(layout.head_dim),
                            block_size=block_size)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--model", required=True, help="a preset name (tiny, ...) or a Hugging Face model directory")
    p.add_argument("--etcd", required=True, help="etcd's client URL, http://HOST:PORT")
    p.add_argument("--listen", required=True, help="HOST:PORT of this worker's control endpoint (HOST: the "
                                                   "address the conductor reaches this host at)")
    p.add_argument("--name", default=None, help="unique in the cluster (default: ROLE-HOST-PORT)")
    p.add_argument("--cluster", default="default", help="the cluster's name in etcd (default: default)")
    p.add_argument("--auth-token-file", default=None, help="the cluster token (default: $MOONCAKE_AUTH_TOKEN)")
    p.add_argument("--dram-bytes", type=int, default=64 << 20, help="store DRAM (default 64 MiB)")
    p.add_argument("--ssd-path", default=None, help="a directory for the store's SSD tier (default: none)")
    p.add_argument("--ssd-bytes", type=int, default=None, help="SSD tier size (default: 4x --dram-bytes)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the random-weight seed of a preset model")
    p.add_argument("--dtype", default=None, help="engine dtype (float32, bfloat16, float16)")
    p.add_argument("--device", default=None, help="engine device (cpu, cuda)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's largest batch (default: the engine's, 64); told to the conductor, whose "
                        "admission holds a decode worker to it")
    p.add_argument("--transfer-port", type=int, default=0, help="the transfer engine's port (default: any)")
    p.add_argument("--transports", default=None,
                   help="comma-separated transfer paths to allow, of local,shm,tcp (default: all)")
    p.add_argument("--ttl", type=int, default=5, help="lease TTL in seconds (default 5)")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats to the conductor")
    p.add_argument("--no-stream-layers", action="store_true",
                   help="a prefill worker sends a request's KV after its whole prefill, not layer by layer")
    add_etcd_arguments(p)
    p.add_argument("--kv-events", default=None,
                   help="publish this prefill worker's store events in vLLM's ZMQ format on tcp://HOST:PORT "
                        "(its replay endpoint on PORT+1)")


def run_worker(args: argparse.Namespace) -> int:
    """Blocks until SIGTERM / SIGINT (or the instance stops)."""
    from ..serving.instance import Instance
    from ..serving.protocol import InstanceSpec, Stop
    from ..serving.worker import beat_loop
    from ..net.auth_socket import AuthListener
    from .registration import WorkerRegistration
    from .worker_link import ConductorLinks

    from .token_check import check_token_with_leader

    token = read_token(args.auth_token_file)
    prefix = cluster_prefix(args.cluster)
    host, port = split_hostport(args.listen, "--listen")
    # a wrong token exits now (2, one line) instead of registering to be refused forever
    check_token_with_leader(etcd_client(args), prefix, token, args.auth_token_file)
    name = args.name or f"{args.role}-{host}-{port}"
    transports = [t.strip() for t in args.transports.split(",")] if args.transports else None
    engine_kwargs: dict[str, Any] = {}
    if args.dtype:
        engine_kwargs["dtype"] = args.dtype
    if args.device:
        engine_kwargs["device"] = args.device
    if args.max_num_seqs is not None:
        if args.max_num_seqs < 1:
            raise InvalidArgument(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    kv_events = kv_replay = None
    if args.kv_events:
        if args.role != "prefill":
            raise InvalidArgument("--kv-events publishes a prefill worker's store events; this is a decode worker")
        from ..serving.kv_events import endpoints_for

        kv_events, kv_replay = endpoints_for(args.kv_events, [name])[name]
    spec = InstanceSpec(0, args.role, name, args.model, args.block_size, args.dram_bytes, args.seed,
                        stream_layers=not args.no_stream_layers, engine_kwargs=engine_kwargs, ssd_path=args.ssd_path,
                        ssd_bytes=(4 * args.dram_bytes if args.ssd_bytes is None else args.ssd_bytes)
                        if args.ssd_path else 0,
                        heartbeat_s=args.heartbeat, kv_events=kv_events, kv_events_replay=kv_replay,
                        transfer_listen=f"{host}:{args.transfer_port}", transports=transports)
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("MOONCAKE_WORKER_THREADS", "1"))))
    links = ConductorLinks(name)
    inst = Instance(spec, links, auth_token=token, peers=links.peers, remote=True)  # type: ignore[arg-type]
    stop = threading.Event()

    def _stop(*_: object) -> None:
        stop.set()
        links.post_local(Stop())

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    from ..serving.shm import clean_at_exit, sweep_dead

    clean_at_exit()  # the arena: daemon threads may keep the instance alive past exit
    sweep_dead()
    listener = AuthListener(host, port, token, links.accept)
    reg = None
    try:
        fp = fingerprint_of(inst.engine, args.model, args.seed, args.block_size)
        st = inst.store.store.stats()
        record = WorkerRecord(name=name, role=args.role, control=listener.address, transfer=inst.endpoint.address,
                              fingerprint=fp, block_bytes=int(inst.layout.block_nbytes),
                              capacity_blocks=int(st.slots_dram + st.slots_ssd))
        reg = WorkerRegistration(etcd_client(args), prefix, record, ttl_s=args.ttl,
                                 token=token).register(wait_s=30.0)
        print(f"mooncake-rs worker {name}: {args.role} on {listener.address} (KV on {inst.endpoint.address}), "
              f"registered in {prefix}", file=sys.stderr, flush=True)
        # (sent to the attached conductor; dropped while none is)
        beat = threading.Thread(target=beat_loop, args=(links, args.heartbeat, stop, [inst]), name="mooncake-beat",
                                daemon=True)
        beat.start()
        inst.run()
    except MooncakeError as e:
        print(f"mooncake-rs worker {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        inst.transport.close()
        return 2
    finally:
        stop.set()
        if reg is not None:
            reg.close()  # first: the conductor drops this worker at once
        listener.close()
        links.close()
    return 0

