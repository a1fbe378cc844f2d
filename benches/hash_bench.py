"""Hashing a prompt from Python (and scheduling it) vs a vLLM-style chained sha256 in
Python, side by side in one run.

The reference is what vLLM does by default: each block's hash is sha256 over the pickled
(parent hash, block tokens as a tuple, extra keys), chained; its tokens are a Python list
(converted before timing, so the reference is not charged for it). A second, faster
reference hashes the raw int32 bytes of each block (no pickle).

Section 1 (the issue 11 target): a 16,384-token prompt at block 16, hashed and scheduled
on a Conductor (4 prefill + 4 decode instances, an index of 100k blocks, half of this
prompt's blocks held by one instance):
  - "BlockHashes": ``c.schedule(rid, hasher.hash_blocks(tokens), ...)``: no Python int
    per block anywhere;
  - "list API": ``c.schedule(rid, hasher.hash(tokens), ...)``: 1,024 Python ints built and
    read back.
Each round times every variant (medians of ``--repeat`` calls; the reference of
``--repeat // 5``); the table shows the median over ``--rounds`` rounds of each time and
of each round's ratio. Tokens are a numpy int32 array (what a tokenizer hands out as
``return_tensors="np"``); the list-of-ints token form is shown as well.

Section 2: hashing only, at block 16 / 64 / 512 (as before, plus ``hash_blocks``).

    python benches/hash_bench.py [--tokens 16384] [--rounds 7] [--repeat 50]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np

from mooncake_rs import BlockHashes, Conductor, ConductorConfig, PrefixHasher


def sha256_pickle_chain(toks: list[int], block_size: int) -> list[int]:
    """vLLM-style: sha256(pickle((parent, tuple(block tokens), extra))), chained."""
    out, parent = [], b""
    for i in range(0, len(toks) - block_size + 1, block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(toks[i : i + block_size]), None))).digest()
        out.append(int.from_bytes(parent[:16], "little"))
    return out


def sha256_bytes_chain(tokens: np.ndarray, block_size: int) -> list[int]:
    out, parent = [], b"\0" * 32
    raw = tokens.astype(np.int32).tobytes()
    step = 4 * block_size
    for i in range(0, len(raw) - step + 1, step):
        parent = hashlib.sha256(parent + raw[i : i + step]).digest()
        out.append(int.from_bytes(parent[:16], "little"))
    return out


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def conductor(block_size: int, held: BlockHashes) -> Conductor:
    c = Conductor(ConductorConfig(block_size=block_size, ttft_slo_s=1e9, tbt_slo_s=1e9, rejection="none"))
    for i in range(4):
        c.add_prefill(i)
        c.add_decode(100 + i)
    rng = np.random.default_rng(1)
    for i in range(4):  # unrelated blocks, so probes miss the cache as in a real index
        c.on_blocks_stored(i, BlockHashes(rng.integers(0, 256, (25_000, 16), dtype=np.uint8)))
    c.on_blocks_stored(1, held)  # a shared prefix (system prompt) on one instance
    return c


def schedule_target(tokens: np.ndarray, block_size: int, rounds: int, repeat: int) -> None:
    h = PrefixHasher(block_size)
    bh = h.hash_blocks(tokens)
    c = conductor(block_size, bh[: len(bh) // 2])
    toks_list = tokens.tolist()
    rid = iter(range(1, 1 << 62))
    n = len(tokens)

    def ours_buffer() -> None:
        r = next(rid)
        c.schedule(r, h.hash_blocks(tokens), n, 0.0)
        c.cancel(r)  # keeps the conductor's state the same for every call (timed too)

    def ours_list() -> None:
        r = next(rid)
        c.schedule(r, h.hash(tokens), n, 0.0)
        c.cancel(r)

    def ours_list_tokens() -> None:
        r = next(rid)
        c.schedule(r, h.hash_blocks(toks_list), n, 0.0)
        c.cancel(r)

    def schedule_only() -> None:
        c.schedule(1 << 62, bh, n, 0.0)
        c.cancel(1 << 62)

    d = c.schedule(0, bh, n, 0.0)
    assert d.prefill == 1 and d.reused_blocks == len(bh) // 2 and h.hash(tokens) == bh.tolist()
    c.cancel(0)
    assert len(sha256_pickle_chain(toks_list, block_size)) == len(bh)
    variants: dict[str, Callable[[], object]] = {
        "BlockHashes: hash_blocks + schedule": ours_buffer,
        "list API: hash + schedule": ours_list,
        "BlockHashes, list-of-int tokens": ours_list_tokens,
        "hash_blocks only": lambda: h.hash_blocks(tokens),
        "hash only (list out)": lambda: h.hash(tokens),
        "schedule(BlockHashes) only": schedule_only,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    ref_times: list[float] = []
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        ref = median_s(lambda: sha256_pickle_chain(toks_list, block_size), max(3, repeat // 5))
        ref_times.append(ref)
        for k, fn in variants.items():
            t = median_s(fn, repeat)
            times[k].append(t)
            ratios[k].append(ref / t)
    print(f"## hash + schedule: {n}-token int32 prompt, block {block_size}, {len(bh)} blocks; "
          f"{rounds} rounds x {repeat} calls (reference {max(3, repeat // 5)})")
    print(f"reference sha256+pickle chain: median {statistics.median(ref_times) * 1e6:.0f} us "
          f"(rounds: {', '.join(f'{t * 1e6:.0f}' for t in ref_times)})")
    print(f"{'variant':<38} {'median us':>10} {'ratio (median)':>15} {'ratio range':>16}")
    for k in variants:
        r = ratios[k]
        print(f"{k:<38} {statistics.median(times[k]) * 1e6:>10.1f} {statistics.median(r):>14.0f}x "
              f"{min(r):>7.0f}-{max(r):.0f}x")


def hash_table(tokens: np.ndarray, repeat: int) -> None:
    toks_list = tokens.tolist()
    print(f"\n## hashing only: {len(tokens)}-token int32 numpy prompt, median of {repeat} runs")
    print(f"{'block':>6} {'hash_blocks us':>15} {'hash us':>8} {'sha256+pickle us':>17} {'ratio':>7} "
          f"{'sha256 bytes us':>16} {'ratio':>7}")
    for bs in (16, 64, 512):
        h = PrefixHasher(bs)
        assert h.hash(tokens) == h.hash_blocks(tokens).tolist()
        ours_b = median_s(lambda: h.hash_blocks(tokens), repeat)
        ours_l = median_s(lambda: h.hash(tokens), repeat)
        ref_p = median_s(lambda: sha256_pickle_chain(toks_list, bs), max(3, repeat // 5))
        ref_b = median_s(lambda: sha256_bytes_chain(tokens, bs), max(3, repeat // 5))
        print(f"{bs:>6} {ours_b * 1e6:>15.1f} {ours_l * 1e6:>8.1f} {ref_p * 1e6:>17.1f} {ref_p / ours_b:>6.0f}x "
              f"{ref_b * 1e6:>16.1f} {ref_b / ours_b:>6.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    tokens = np.random.default_rng(0).integers(0, 128_000, args.tokens, dtype=np.int32)
    schedule_target(tokens, args.block, args.rounds, args.repeat)
    hash_table(tokens, args.repeat)


if __name__ == "__main__":
    main()
