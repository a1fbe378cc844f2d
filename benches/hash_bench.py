"""PrefixHasher from Python vs chained hashlib.sha256 in Python, same prompt, same run.

The reference is what vLLM does by default: each block's hash is sha256 over the pickled
(parent hash, block tokens, extra keys), chained. A second, faster reference hashes the
raw int32 bytes of each block (no pickle), to show the ratio is not only pickle's cost.

    python benches/hash_bench.py [--tokens 16384] [--repeat 30]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import statistics
import time

import numpy as np

from mooncake_rs import PrefixHasher


def sha256_pickle_chain(tokens: np.ndarray, block_size: int) -> list[int]:
    out, parent = [], b""
    toks = tokens.tolist()
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


def median_s(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    tokens = np.random.default_rng(0).integers(0, 128_000, args.tokens, dtype=np.int32)
    print(f"{args.tokens}-token int32 numpy prompt, median of {args.repeat} runs")
    print(f"{'block':>6} {'ours us':>9} {'sha256+pickle us':>17} {'ratio':>7} {'sha256 bytes us':>16} {'ratio':>7} {'ours GB/s':>10}")
    for bs in (16, 64, 512):
        h = PrefixHasher(bs)
        assert len(h.hash(tokens)) == len(sha256_pickle_chain(tokens, bs))
        ours = median_s(lambda: h.hash(tokens), args.repeat)
        ref_p = median_s(lambda: sha256_pickle_chain(tokens, bs), max(3, args.repeat // 5))
        ref_b = median_s(lambda: sha256_bytes_chain(tokens, bs), max(3, args.repeat // 5))
        print(
            f"{bs:>6} {ours * 1e6:>9.1f} {ref_p * 1e6:>17.1f} {ref_p / ours:>6.0f}x "
            f"{ref_b * 1e6:>16.1f} {ref_b / ours:>6.0f}x {tokens.nbytes / ours / 1e9:>10.2f}"
        )


if __name__ == "__main__":
    main()
