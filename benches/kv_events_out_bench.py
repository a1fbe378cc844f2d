"""KV events out: what publishing costs the prefill instance's loop, per block.

Side by side in one run, per block of a 64-block prompt (block_size 16):
- reference: the store work the instance does anyway (reserve + commit a block, drain
  the store's events);
- ours: ``KVEventsOut.learn`` (remember the request's tokens) plus
  ``on_store_events`` (store events -> BlockStored/BlockRemoved, queued to the PUB
  thread), with no subscriber in the process; then, in other rounds, the end to end rate to a ``KVEventSubscriber`` + ``Ingestor``
  into a ``BlockIndex`` (all blocks received and indexed).

Usage: python benches/kv_events_out_bench.py [--prompts 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import time

from mooncake_rs import BlockIndex, PrefixHasher, Store
from mooncake_rs.kv_events import Ingestor, KVEventSubscriber
from mooncake_rs.kv_events.targets import TierTarget
from mooncake_rs.serving.kv_events import KVEventsOut

BS, BLOCKS = 16, 64


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_round(n_prompts: int, seed: int, subscribe: bool) -> tuple[float, float, float]:
    rng = random.Random(seed)
    hasher = PrefixHasher(BS, seed=0)
    prompts = [[rng.randrange(32000) for _ in range(BS * BLOCKS)] for _ in range(n_prompts)]
    keys = [hasher.hash(p) for p in prompts]
    nblocks = n_prompts * BLOCKS
    store = Store(4096, 4096 * nblocks // 2)  # half fit: evictions too
    p = _port()
    out = KVEventsOut(f"tcp://127.0.0.1:{p}", None, BS, capacity=2 * nblocks)
    index = BlockIndex()
    ing = Ingestor(TierTarget(index), 0, PrefixHasher(BS, seed=0))
    sub = KVEventSubscriber(out.endpoint, ing, replay_endpoint=out.replay_endpoint)
    if subscribe:
        sub.start()
        time.sleep(0.3)
    t_store = t_pub = 0.0
    t0 = time.perf_counter()
    for prompt, ks in zip(prompts, keys):
        a = time.perf_counter()
        for k in ks:
            blk = store.reserve(k).commit()
            if blk is not None:
                blk.release()
        data = store.drain_events_batch().to_bytes()
        b = time.perf_counter()
        out.learn(ks, prompt)
        out.on_store_events(data)
        c = time.perf_counter()
        t_store += b - a
        t_pub += c - b
    if not subscribe:  # the instance's own cost (the PUB thread encodes meanwhile)
        time.sleep(0.2)
        sub.stop()
        out.close()
        return t_store / nblocks * 1e6, t_pub / nblocks * 1e6, 0.0
    want = nblocks
    deadline = time.monotonic() + 60
    while ing.stats().stored_blocks < want and time.monotonic() < deadline:
        time.sleep(0.001)
    t_e2e = time.perf_counter() - t0
    got = ing.stats().stored_blocks
    sub.stop()
    out.close()
    if got < want:
        raise SystemExit(f"only {got} of {want} blocks arrived")
    return t_store / nblocks * 1e6, t_pub / nblocks * 1e6, nblocks / t_e2e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    alone = [one_round(a.prompts, seed, False) for seed in range(a.rounds)]
    e2e_rows = [one_round(a.prompts, seed, True) for seed in range(a.rounds)]
    for i, ((s, pub, _), (_, _, e2e)) in enumerate(zip(alone, e2e_rows)):
        print(f"round {i}: store {s:.2f} us/block, publish {pub:.2f} us/block ({pub / s:.2f}x), "
              f"end to end {e2e / 1e3:.0f} k blocks/s")
    s = statistics.median(r[0] for r in alone)
    pub = statistics.median(r[1] for r in alone)
    e2e = statistics.median(r[2] for r in e2e_rows)
    print(f"median: store {s:.2f} us/block, publish {pub:.2f} us/block ({pub / s:.2f}x of the store work), "
          f"end to end to a subscriber in this process {e2e / 1e3:.0f} k blocks/s ({a.prompts * BLOCKS} blocks a round)")


if __name__ == "__main__":
    main()
