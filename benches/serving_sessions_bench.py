"""Agent-like sessions through a real ``Cluster`` (CPU, random weights): how many prompt
tokens the prefill instances compute and what the requests' TTFT is, for one build.

Each session's next step is its previous prompt plus a tool result, sent on a fixed
schedule whether or not the previous step has finished (as an agent's trace in the
simulator: the step often arrives while its predecessor is still queued). The conductor
prices such a step as a local hit on its predecessor's instance (pending prefixes,
docs/conductor.md); the tokens the cluster really computes show whether it executes that.

    python benches/serving_sessions_bench.py                 # this checkout's package
    python benches/serving_sessions_bench.py --builds A B    # each checkout in turn, interleaved
    python benches/serving_sessions_bench.py --gap 0.005 --model 8-layer --sessions 12 --steps 5

``--gap``: the mean time between a session's steps (each gap is 0.25-1.5 times it); the
shorter it is against the prefill time, the more steps arrive while their predecessor
is still on its instance.

With ``--builds`` each checkout's ``python/`` goes first on ``PYTHONPATH`` in a fresh
process; runs are interleaved (A, B, A, B, ...) and medians printed. Greedy outputs must
be equal across builds (the same trace, the same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

BS = 16


def trace(sessions: int, steps: int, seed: int, gap_s: float) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt, session) for every step of every session, by arrival."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(6 * BS, 12 * BS))]
        t = s * gap_s / 2
        for _ in range(steps):
            out.append((t, list(prompt), s))
            prompt = prompt + [rng.randrange(256) for _ in range(rng.randrange(BS, 4 * BS))]
            t += rng.uniform(0.25, 1.5) * gap_s  # the next step comes soon: often before this one ended
    out.sort(key=lambda x: x[0])
    return out


EIGHT_LAYERS = dict(vocab_size=256, hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=256,
                    max_position_embeddings=8192, name="8-layer")


def run_one(sessions: int, steps: int, seed: int, prefill: int, gap_s: float, model: str) -> dict:
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    params = SamplingParams(max_tokens=4)
    reqs = trace(sessions, steps, seed, gap_s)
    cfg = ModelConfig.tiny() if model == "tiny" else ModelConfig(**EIGHT_LAYERS)
    with Cluster(cfg, prefill=prefill, decode=1, block_size=BS, dram_bytes_per_instance=64 << 20,
                 seed=3) as c:
        c.generate([[1] * 40], params)  # warm up
        t0 = time.monotonic()
        handles = []
        for at, prompt, _ in reqs:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            handles.append(c.submit(prompt, params))
        outs = [h.result(120) for h in handles]
        wall = time.monotonic() - t0
    ttft = [o.metrics.ttft_s for o in outs]
    last: dict[int, int] = {}
    moved = 0  # steps prefilled on another instance than their session's previous step
    for (_, _, sess), o in zip(reqs, outs):
        inst = o.metrics.prefill_instance
        moved += sess in last and last[sess] != inst
        last[sess] = inst
    return {"computed": sum(o.metrics.computed_tokens for o in outs),
            "reused": sum(o.metrics.reused_tokens for o in outs),
            "fetched": sum(o.metrics.fetched_tokens for o in outs),
            "prompt": sum(len(p) for _, p, _ in reqs), "moved": moved,
            "ttft_mean": statistics.fmean(ttft), "ttft_p90": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
            "wall": wall, "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.02, help="mean seconds between a session's steps (x0.25-1.5)")
    ap.add_argument("--model", choices=["tiny", "8-layer"], default="tiny")
    ap.add_argument("--builds", nargs="*", help="checkouts to compare (their python/ directories)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one run, for --builds
    a = ap.parse_args()
    if a.json:
        print(json.dumps(run_one(a.sessions, a.steps, a.seed, a.prefill, a.gap, a.model)))
        return
    builds = a.builds or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    runs: dict[str, list[dict]] = {b: [] for b in builds}
    for _ in range(a.reps):
        for b in builds:
            env = dict(os.environ, PYTHONPATH=os.path.join(b, "python"))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--sessions", str(a.sessions),
                                  "--steps", str(a.steps), "--seed", str(a.seed), "--prefill", str(a.prefill),
                                  "--gap", str(a.gap), "--model", a.model],
                                 env=env, capture_output=True, text=True, check=True, cwd=b)
            runs[b].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = runs[builds[0]][0]["outputs"]
    same = all(r["outputs"] == first for rs in runs.values() for r in rs)
    print(f"sessions={a.sessions} steps={a.steps} prefill={a.prefill} seed={a.seed} reps={a.reps} gap={a.gap} "
          f"model={a.model} "
          f"prompt tokens={runs[builds[0]][0]['prompt']} outputs equal across builds: {same}")
    print(f"{'build':<28} {'computed':>9} {'reused':>8} {'fetched':>8} {'ttft mean ms':>12} {'ttft p90 ms':>11} "
          f"{'wall s':>7} {'moved':>5}")
    for b, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("computed", "reused", "fetched", "ttft_mean",
                                                               "ttft_p90", "wall", "moved")}
        print(f"{os.path.basename(b.rstrip('/')):<28} {m['computed']:>9.0f} {m['reused']:>8.0f} {m['fetched']:>8.0f} "
              f"{m['ttft_mean'] * 1e3:>12.1f} {m['ttft_p90'] * 1e3:>11.1f} {m['wall']:>7.2f} {m['moved']:>5.0f}  "
              f"computed per run: {' '.join(str(r['computed']) for r in rs)}")


if __name__ == "__main__":
    main()
