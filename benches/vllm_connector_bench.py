"""MooncakeRsConnector's save and load paths against a plain torch copy of the same bytes.

The worker side of the connector (integrations/vllm/worker.py) runs as vLLM drives it,
without vLLM's model: KV tensors in vLLM's CPU layout ([num_blocks, 2, block, heads*dim],
bf16), a KV pool in another process (``mooncake-rs kv-pool``; the worker maps its arena and
copies a layer's blocks with one ``copy_segments`` call, each block's CRC-32 folded into
the copy; ``--transports tcp`` measures the transfer engine's path instead), and per layer:
- save: ``save_kv_layer`` (N blocks of the layer into reserved slots, with checksums) and
  the wait for its writes; the reserve and commit calls (one each per step) are timed apart;
- load: ``start_load_kv`` and ``wait_for_layer_load`` of each layer, divided by the
  layers (the checksums are taken in the copy); the end-of-step comparison of the
  checksums (``get_block_ids_with_load_errors``; on the engine's path, a CRC pass over the
  loaded bytes) is timed apart and shown added.
Reference, same bytes, same run, between the same tensors: the pool's arena mapped here
as a ``[slots, slot_stride]`` uint8 tensor and ``arena[slots, :n] = layer[ids]`` (one torch
call that gathers one layer's blocks and writes them into the very slots the connector
wrote), and a ``copy_`` per block between the same views; the faster of the two is the
reference, timed right after the connector's save of those blocks.

``--clock cpu`` times this thread's CPU time (``time.thread_time``) instead of the wall
clock: on a host whose cores are shared with other busy processes, a copy of several
milliseconds is preempted for some of them while a short reference copy mostly is not,
which the wall clock counts against the longer one; CPU time counts what each costs.
(Then the reserve+commit column holds only this process's share: the pool's work is in
another process.)

    python benches/vllm_connector_bench.py [--blocks 64] [--repeat 20] [--transports tcp] [--clock cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import torch

TOKEN = "bench-token-0123456789abcdef0123"

clock = time.perf_counter  # --clock cpu: time.thread_time

SHAPES = {  # name: (layers, kv heads, head dim, block tokens)
    "tiny (2 KV heads x 32, block 32)": (2, 2, 32, 32),
    "Llama-3-8B layer (8 KV heads x 128, block 32)": (4, 8, 128, 32),
}


def start_pool(memory: str) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MOONCAKE_AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs", "kv-pool", "--listen", f"127.0.0.1:{port}",
                             "--memory", memory], env=env, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()
    if "KV pool on" not in line:
        raise RuntimeError(f"kv-pool did not start: {line}")
    return proc, f"127.0.0.1:{port}"


def map_arena(opened) -> torch.Tensor:
    """The pool's arena, mapped here as a [slots, slot_stride] uint8 tensor (for the reference)."""
    import mmap

    fd = os.open("/dev/shm/" + opened.shm_name.lstrip("/"), os.O_RDWR)
    try:
        m = mmap.mmap(fd, opened.slots * opened.slot_stride)
    finally:
        os.close(fd)
    return torch.frombuffer(m, dtype=torch.uint8).view(opened.slots, opened.slot_stride)


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def bench_shape(name: str, layers: int, heads: int, dim: int, block: int, n: int, repeat: int, pool: str,
                transports: tuple[str, ...] | None) -> None:
    from mooncake_rs.integrations.vllm.config import ConnectorSettings
    from mooncake_rs.integrations.vllm.metadata import LoadSpec, MooncakeRsConnectorMetadata, SaveSpec
    from mooncake_rs.integrations.vllm.worker import ConnectorWorker
    from mooncake_rs import BlockHashes

    num_blocks = 4 * n
    kv = {f"layer.{i}": torch.randn(num_blocks, 2, block, heads * dim).to(torch.bfloat16) for i in range(layers)}
    settings = ConnectorSettings(pool=pool, auth_token=TOKEN, advertise=pool, role="kv_both", model_id="bench",
                                 verify_checksums=True, timeout_s=30.0, transports=transports)
    w = ConnectorWorker(settings, num_blocks)
    w.register_kv_caches(kv)
    layer_bytes = n * w.layout.layers[0].block_bytes
    ids = list(range(0, 2 * n, 2))
    first = next(iter(kv.values()))
    idx = torch.tensor(ids)
    arena = map_arena(w._pools[pool].client.open(w.layout.block_bytes, w.layout.fingerprint))
    layer0 = first.view(torch.uint8).view(num_blocks, -1)
    seg = w.layout.layers[0].block_bytes
    same: list[float] = []

    save_layer, step_overhead, loads, crcs = [], [], [], []
    for r in range(repeat):
        keys = bytes(BlockHashes([uuid.uuid4().int for _ in ids]))
        meta = MooncakeRsConnectorMetadata(saves=[SaveSpec("r", ids, keys)])
        t0 = clock()
        w.begin_step(meta)  # reserve
        t1 = clock()
        w.save_kv_layer("layer.0")
        for batch, *_ in w._save_batches:
            batch.wait()
        t2 = clock()
        for i in range(1, layers):
            w.save_kv_layer(f"layer.{i}")
        t3 = clock()
        w.wait_for_save()  # waits the rest, commits
        t4 = clock()
        save_layer.append(t2 - t1)
        step_overhead.append((t1 - t0) + (t4 - t3))
        # torch between the same tensors: layer 0 of these blocks into the same pool slots
        slots = torch.tensor([o // arena.shape[1] for o in w._pools[pool].client.lookup(keys).offsets])

        def plain() -> None:
            arena[slots, :seg] = layer0[idx]  # one torch call: gather the blocks, scatter into the slots

        pairs = list(zip(slots.tolist(), ids))

        def per_block() -> None:
            for slot, b in pairs:  # one copy_ a block: memcpy-speed, a call each
                arena[slot, :seg].copy_(layer0[b])

        same.append(min(median_s(plain, 3), median_s(per_block, 3)))
        found = w._pools[pool].client.lookup(keys)
        assert found.count == n, found.count
        load_ids = list(range(1, 2 * n, 2))
        spec = LoadSpec("r", pool, load_ids, list(found.offsets), list(found.checksums), keys)
        t0 = clock()
        w.start_load_kv(MooncakeRsConnectorMetadata(loads=[spec]))
        w.wait_for_layer_load("layer.0")
        t1 = clock()
        for i in range(1, layers):
            w.wait_for_layer_load(f"layer.{i}")
        t2 = clock()
        assert not w.get_block_ids_with_load_errors()  # the CRC check of every block
        t3 = clock()
        loads.append((t2 - t0) / layers)  # every layer's reads, pipelined, per layer
        crcs.append((t3 - t2) / layers)
    for i in range(layers):  # what was loaded is what was saved
        assert torch.equal(kv[f"layer.{i}"][1:2 * n:2], kv[f"layer.{i}"][0:2 * n:2])
    gb = lambda s: layer_bytes / s / 1e9  # noqa: E731
    s, l_ = statistics.median(save_layer), statistics.median(loads)
    c = statistics.median(crcs)
    ref = statistics.median(same)
    print(f"| {name} | {n} | {layer_bytes >> 10} KiB | {gb(ref):.2f} | {gb(s):.2f} ({ref / s:.2f}x) | "
          f"{gb(l_):.2f} ({ref / l_:.2f}x) | {gb(l_ + c):.2f} ({ref / (l_ + c):.2f}x) | "
          f"{statistics.median(step_overhead) * 1e3:.2f} ms |", flush=True)
    w.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per layer per step (default 64)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--transports", default=None, help="the worker's transports, e.g. tcp (default: shm, tcp)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this thread's CPU time (a host shared with busy processes)")
    args = ap.parse_args()
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)  # as a vLLM CPU worker bound to one core (VLLM_CPU_OMP_THREADS_BIND)
    print("| shape | blocks | bytes/layer | torch, same tensors GB/s | save GB/s (x ref) | load GB/s (x ref) | "
          "load + step's check GB/s (x ref) | reserve+commit per step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (layers, heads, dim, block) in SHAPES.items():
        proc, pool = start_pool("1G")  # one pool serves one layout
        try:
            bench_shape(name, layers, heads, dim, block, args.blocks, args.repeat, pool,
                        tuple(args.transports.split(",")) if args.transports else None)
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
