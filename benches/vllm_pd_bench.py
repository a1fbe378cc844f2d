"""TTFT and TBT of real vLLM (CPU) in three set-ups, same prompts, same run:

1. 1P+1D through ``serve --upstream prefill:..,decode:..`` with MooncakeRsConnector (KV
   through a KV pool, shm);
2. the same 1P+1D with vLLM's ExampleConnector (its disk-based reference: safetensors
   files per layer in a directory);
3. one vLLM alone (the client talks to it directly).

Each prompt is new to every instance (random ids, a seed per prompt), streamed, greedy,
``ignore_eos``. TTFT = request sent -> first token at the client; TBT = first token -> last
token over the tokens after the first (token ids counted per chunk). Medians over the
prompts. The engine's own TBT is read beside it: the mean of vLLM's
``vllm:inter_token_latency_seconds`` on the instance that decodes (its ``/metrics``,
before and after the measured prompts), which a slow client reading merged chunks cannot
blur. The tiny random-weight
Llama of the tests (tests/vllm_support.py), block 32, one core per vLLM instance.

    python benches/vllm_pd_bench.py [--prompts 8] [--prompt-blocks 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

TOKEN = "bench-token-0123456789abcdef0123"


def stream_one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(TTFT, TBT) of one streamed request. TBT is the time from the first token to the
    last over the tokens after the first: a chunk may carry several tokens (vLLM merges
    the deltas a slow reader has not taken yet), so chunk gaps would understate it."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                n = sum(len(c.get("token_ids") or []) for c in choices)
                if n:
                    last = time.perf_counter()
                    if not tokens:
                        first = last
                    tokens += n
    return first - t0, (last - first) / max(1, tokens - 1), last - t0


def itl_totals(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of vLLM's inter-token latency histogram at ``url``."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:inter_token_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def run_prompts(url: str, prompts: list[list[int]], max_tokens: int, decoder: str | None = None) -> dict[str, float]:
    """Streams ``prompts`` one by one through ``url``; ``decoder``: the vLLM instance that
    decodes them (its /metrics give the engine's inter-token latency)."""
    ttft, tbt, e2e = [], [], []
    before = itl_totals(decoder or url)
    for p in prompts:
        t, b, e = stream_one(url, p, max_tokens)
        ttft.append(t)
        tbt.append(b)
        e2e.append(e)
    after = itl_totals(decoder or url)
    engine_itl = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    return {"engine_itl_ms": engine_itl * 1e3, "ttft_ms": statistics.median(ttft) * 1e3,
            "tbt_ms": statistics.median(tbt) * 1e3,
            "e2e_ms": statistics.median(e2e) * 1e3, "tpot_ms": statistics.median(
                [(e - t) / max(1, max_tokens - 1) for t, e in zip(ttft, e2e)]) * 1e3}


def start_proxy(prefill, decode, model_dir: Path, logdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from vllm_support import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "mooncake_rs", "serve", "--tokenizer", str(model_dir), "--block-size", "32",
           "--port", str(port), "--upstream", f"prefill:p={prefill.url},events={prefill.events_endpoint}",
           "--upstream", f"decode:d={decode.url}"]
    proc = subprocess.Popen(cmd, stdout=open(logdir / "proxy.log", "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("serve --upstream did not start")


def pd_run(name: str, ktc: dict, model_dir: Path, logdir: Path, prompts, max_tokens: int) -> dict[str, float]:
    from vllm_support import start_all, vllm_server

    servers = [vllm_server(model_dir, kv_transfer_config=ktc, cpu=str(i % (os.cpu_count() or 1)), log_dir=logdir)
               for i in range(2)]
    start_all(servers)
    proc = None
    try:
        proc, url = start_proxy(servers[0], servers[1], model_dir, logdir)
        stream_one(url, [5, 6, 7] * 20, 4)  # warm-up (not measured)
        return run_prompts(url, prompts, max_tokens, decoder=servers[1].url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-blocks", type=int, default=16, help="full blocks of 32 tokens a prompt (+ 7 tokens)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from mooncake_rs.integrations.pool import KVPoolServer, PoolConfig
    from vllm_support import make_vllm_model, start_vllm

    tmp = Path(tempfile.mkdtemp(prefix="vllm-pd-bench-"))
    model = make_vllm_model(tmp / "model")
    prompts = [[int(x) for x in np.random.default_rng(1000 + i).integers(10, 300, args.prompt_blocks * 32 + 7)]
               for i in range(args.prompts)]
    rows = {}
    with KVPoolServer(PoolConfig(auth_token=TOKEN, dram_bytes=512 << 20)) as pool:
        ours = {"kv_connector": "MooncakeRsConnector", "kv_connector_module_path": "mooncake_rs.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"pool": pool.address, "auth_token": TOKEN}}
        rows["1P+1D, MooncakeRsConnector"] = pd_run("ours", ours, model, tmp, prompts, args.max_tokens)
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-kv")}}
    rows["1P+1D, ExampleConnector"] = pd_run("example", example, model, tmp, prompts, args.max_tokens)
    one = start_vllm(model, cpu="0", log_dir=tmp)
    try:
        stream_one(one.url, [5, 6, 7] * 20, 4)
        rows["one vLLM"] = run_prompts(one.url, prompts, args.max_tokens)
    finally:
        one.stop()
    print(f"{args.prompts} prompts of {args.prompt_blocks * 32 + 7} tokens, {args.max_tokens} output tokens, streamed")
    print("| set-up | TTFT p50 ms | TBT p50 ms (first->last token) | decoder's inter-token latency, mean ms "
          "(vLLM /metrics) | request p50 ms | (request - TTFT) / (tokens - 1) ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v['ttft_ms']:.1f} | {v['tbt_ms']:.2f} | {v['engine_itl_ms']:.2f} | {v['e2e_ms']:.1f} "
              f"| {v['tpot_ms']:.2f} |")


if __name__ == "__main__":
    main()
