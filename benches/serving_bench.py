"""Serving benchmarks (CPU): prefix reuse vs recompute, layer-wise streaming vs send-after,
and KV transfer bandwidth during serving with worker processes vs the shm transport.

    python benches/serving_bench.py            # all three, a few minutes
    python benches/serving_bench.py --only ttft|stream|transfer|transfer_grants

1. TTFT of prompts of 8/16/32 blocks with 0/50/95% of the prefix cached (warmed by an
   earlier request) against the same prompts with prefix reuse disabled; compared with
   the saved-compute expectation, the standalone engine prefill time ratio
   T(n, 0) / T(n - c, c) measured in the same run (paper Fig. 14b).
2. Time from prefill start to decode-ready (all KV in the decode instance's slots),
   layer-wise streaming vs sending after the whole prefill, cold prompts of 16/32/64 blocks,
   on an 8-layer model (layer-wise overlap needs layers to overlap with).
3. processes=True: bytes the prefill workers' transfer engines moved into the decode
   worker's shared-memory arena per second with a transfer in flight (both counted by
   the engines themselves: ``TransferEngine.stats()``), every (prefill, decode) pair
   warmed up first, against the shm transport's own benchmark (4 MiB x 64 writes to a
   peer process, benches/transfer_bench.py) in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mooncake_rs import Cluster  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402

BS = 16
ONE = SamplingParams(max_tokens=1)
EIGHT_LAYERS = ModelConfig(vocab_size=256, hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                           intermediate_size=256, max_position_embeddings=8192, name="8-layer")
WIDE = ModelConfig(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                   intermediate_size=512, max_position_embeddings=8192, name="wide-kv")


def med(xs):
    return statistics.median(xs)


MODELS = {"tiny": "tiny", "8-layer": EIGHT_LAYERS, "wide": WIDE}


def bench_ttft(reps: int, model_name: str = "tiny") -> None:
    model = MODELS[model_name]
    print(f"== TTFT: prefix reuse vs full recompute ({model_name} model, CPU, block 16)")
    rng = random.Random(0)
    eng = Engine(model, block_size=BS, seed=0)
    print(f"{'blocks':>6} {'cached':>6} {'reuse ms':>9} {'recompute ms':>12} {'speedup':>8} {'expected':>9} "
          f"{'tokens ratio':>12}")
    with Cluster(model, prefill=1, decode=1, block_size=BS, seed=0) as warm, \
            Cluster(model, prefill=1, decode=1, block_size=BS, seed=0, prefix_reuse=False) as cold:
        for c in (warm, cold):  # warm up both
            c.generate([[1] * 64], ONE)
        for nb in (8, 16, 32):
            n = nb * BS
            for frac in (0.0, 0.5, 0.95):
                cb = int(round(nb * frac))
                cached = cb * BS
                t_reuse, t_cold = [], []
                for _ in range(reps):
                    prefix = [rng.randrange(256) for _ in range(cached)]
                    prompt = prefix + [rng.randrange(256) for _ in range(n - cached)]
                    if cached:
                        warm.generate([prefix + [0]], ONE)  # puts the prefix blocks in the store
                    o = warm.generate([prompt], ONE)[0]
                    assert o.metrics.reused_tokens == min(cached, (n - 1) // BS * BS), o.metrics
                    t_reuse.append(o.metrics.ttft_s)
                    t_cold.append(cold.generate([prompt], ONE)[0].metrics.ttft_s)
                new = n - min(cached, (n - 1) // BS * BS)
                full, part = eng.measure_prefill([(n, 0), (new, n - new)], repeats=reps)
                print(f"{nb:6d} {(n - new) / n:6.0%} {med(t_reuse) * 1e3:9.2f} {med(t_cold) * 1e3:12.2f} "
                      f"{med(t_cold) / med(t_reuse):8.2f} {full.seconds / part.seconds:9.2f} {n / new:12.2f}")


def bench_stream(reps: int, link: float | None) -> None:
    where = "local path, no link limit" if link is None else f"emulated {link / 1e6:.0f} MB/s link"
    print(f"== prefill start -> decode-ready: layer-wise streaming vs send after prefill (8-layer model, CPU, {where})")
    rng = random.Random(1)
    print(f"{'blocks':>6} {'layer-wise ms':>13} {'after ms':>9} {'ratio':>6}")
    kw = dict(prefill=1, decode=1, block_size=BS, seed=0, prefix_reuse=False, link_bandwidth=link,
              engine_kwargs={"max_num_batched_tokens": 256})
    with Cluster(EIGHT_LAYERS, stream_layers=True, **kw) as a, Cluster(EIGHT_LAYERS, stream_layers=False, **kw) as b:
        for c in (a, b):
            c.generate([[1] * 64], ONE)
        for nb in (16, 32, 64):
            ra, rb = [], []
            for _ in range(reps):
                p = [rng.randrange(256) for _ in range(nb * BS)]
                ma = a.generate([p], SamplingParams(max_tokens=2))[0].metrics
                mb = b.generate([p], SamplingParams(max_tokens=2))[0].metrics
                ra.append(ma.kv_ready_s)
                rb.append(mb.kv_ready_s)
            print(f"{nb:6d} {med(ra) * 1e3:13.2f} {med(rb) * 1e3:9.2f} {med(rb) / med(ra):6.2f}")


def _serve_kv(kv_grants: bool, rounds: int) -> dict[str, float]:
    """KV moved prefill -> decode workers while serving, with ``kv_grants`` on or off."""
    rng = random.Random(2)
    with Cluster(WIDE, prefill=2, decode=1, block_size=64, seed=0, processes=True, prefix_reuse=False,
                 dram_bytes_per_instance=256 << 20, kv_grants=kv_grants) as c:
        for _ in range(3):  # warm-up: first contact of each pair (connect, shm map) not counted
            c.generate([[rng.randrange(256) for _ in range(128)] for _ in range(4)], ONE)
        base = c.instance_stats()
        t0 = time.monotonic()
        ready = []
        for _ in range(rounds):
            prompts = [[rng.randrange(256) for _ in range(64 * 24)] for _ in range(8)]
            ready += [o.metrics.kv_ready_s for o in c.generate(prompts, SamplingParams(max_tokens=2))]
        wall = time.monotonic() - t0
        st = c.instance_stats()
    moved = sum(st[i]["copied_bytes"] - base[i]["copied_bytes"] for i in (0, 1))
    busy = sum(st[i]["copy_busy_s"] - base[i]["copy_busy_s"] for i in (0, 1))
    return {"GBps": moved / max(busy, 1e-9) / 1e9, "MB": moved / 1e6, "kv_ready_ms": med(ready) * 1e3,
            "wall_s": wall}


def bench_transfer_grants(rounds: int = 3) -> None:
    print("== kv_grants off vs on, processes=True (wide-KV model, 2 prefill + 1 decode, 24-block prompts); "
          "on: restricted decode arena, per-request grants, per-prefill tokens: KV through the staged path (one copy "
          "by the decode's server from the prefill's buffer, or per-peer staging buffers where the kernel refuses; "
          "every chunk checked against the live grants), not a mapping of the arena")
    off, on = _serve_kv(False, rounds), _serve_kv(True, rounds)
    print(f"{'':11s} {'GB/s in flight':>15s} {'KV-ready ms (median)':>21s} {'wall s':>7s} {'MB':>7s}")
    for name, r in (("off (shm)", off), ("on (staged)", on)):
        print(f"{name:11s} {r['GBps']:15.2f} {r['kv_ready_ms']:21.2f} {r['wall_s']:7.2f} {r['MB']:7.1f}")
    print(f"ratio on/off: bandwidth {on['GBps'] / off['GBps']:.2f}, KV-ready {on['kv_ready_ms'] / off['kv_ready_ms']:.2f}, "
          f"wall {on['wall_s'] / off['wall_s']:.2f}")


def bench_transfer(budget: float) -> None:
    print("== KV transfer during serving, processes=True (wide-KV model: 128 KiB per layer span, block 64)")
    from transfer_bench import bench_shm

    rng = random.Random(2)
    with Cluster(WIDE, prefill=2, decode=1, block_size=64, seed=0, processes=True, prefix_reuse=False,
                 dram_bytes_per_instance=256 << 20) as c:
        # Warm-up until every prefill worker has sent KV to the decode worker: the first
        # batch of a new (prefill, decode) pair maps the decode arena's shm segment, a
        # one-time cost reported on its own line, not bandwidth.
        cold0 = c.instance_stats()
        for _ in range(8):
            c.generate([[rng.randrange(256) for _ in range(128)] for _ in range(4)], ONE)
            base = c.instance_stats()
            if all(base[i]["copied_bytes"] > cold0[i]["copied_bytes"] for i in (0, 1)):
                break
        cold_moved = sum(base[i]["copied_bytes"] - cold0[i]["copied_bytes"] for i in (0, 1))
        cold_busy = sum(base[i]["copy_busy_s"] - cold0[i]["copy_busy_s"] for i in (0, 1))
        t0 = time.monotonic()
        prompts = [[rng.randrange(256) for _ in range(64 * 24)] for _ in range(16)]
        outs = c.generate(prompts, SamplingParams(max_tokens=2))
        wall = time.monotonic() - t0
        st = c.instance_stats()
    moved = sum(st[i]["copied_bytes"] - base[i]["copied_bytes"] for i in (0, 1))
    busy = sum(st[i]["copy_busy_s"] - base[i]["copy_busy_s"] for i in (0, 1))
    sent = sum(o.metrics.transferred_bytes for o in outs)
    serving = moved / busy / 1e9
    shm = bench_shm(budget)
    ref = shm["shm_write_GBps"]
    print(f"warm-up, first contact of each pair included: {cold_moved / 1e6:.1f} MB in {cold_busy:.3f} s in flight "
          f"-> {cold_moved / max(cold_busy, 1e-9) / 1e9:.2f} GB/s")
    print(f"serving: {sent / 1e6:.1f} MB of KV to the decode worker in {wall:.2f} s of serving; "
          f"transfers in flight {busy:.3f} s (the engines' own count) -> {serving:.2f} GB/s")
    print(f"shm transport benchmark (4 MiB x 64 writes to a peer process): {ref:.2f} GB/s; "
          f"np.copyto {shm.get('copyto_GBps', float('nan')):.2f} GB/s")
    print(f"ratio serving / shm transport: {serving / ref:.2f} (target >= 0.7)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("ttft", "stream", "transfer", "transfer_grants"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny", help="model of the TTFT benchmark")
    ap.add_argument("--budget", type=float, default=3.0)
    args = ap.parse_args()
    if args.only in (None, "ttft"):
        bench_ttft(args.reps, args.model)
    if args.only in (None, "stream"):
        bench_stream(args.reps, None)
        bench_stream(args.reps, 50e6)
    if args.only in (None, "transfer"):
        bench_transfer(args.budget)
    if args.only in (None, "transfer_grants"):
        bench_transfer_grants()


if __name__ == "__main__":
    main()
