"""The HTTP front's overhead (CPU, tiny model): TTFT through ``/v1/completions``
(streaming) against ``Cluster.submit`` directly, requests/s at 64 concurrent streams
against the same load submitted directly, and where the front's CPU goes.

    python benches/http_front_bench.py                 # about two minutes on 2 cores
    python benches/http_front_bench.py --requests 256 --concurrency 64 --ttft-prompts 40

The server runs as ``python -m mooncake_rs serve`` in its own process (its own GIL, its
own embedded cluster, prefill 2 + decode 1, prefix reuse off so both sides compute
every prompt); the direct side is a ``Cluster`` of the same configuration in this
process. Both are measured in the same run, alternating prompt by prompt (TTFT) and
phase by phase (throughput); the other side idles meanwhile. The profile is a second,
short server run under cProfile, which sees the event-loop thread (the front) only: the
cluster's router and instances are threads of their own.
"""

from __future__ import annotations

import argparse
import json
import asyncio
import os
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny chat model writer the tests use

from ports import free_port  # noqa: E402

import httpx  # noqa: E402

import text_helpers as th  # noqa: E402

MODEL = "tiny-chat"
WORDS = "the quick brown fox jumps over the lazy dog hello world cache block prefill decode".split()


def prompts(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 30))) for _ in range(n)]


class Server:
    """``mooncake-rs serve`` in a subprocess (optionally under cProfile)."""

    def __init__(self, model_dir: Path, profile_to: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "mooncake_rs", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--prefill", "2", "--decode", "1", "--no-prefix-reuse", *extra]
        if profile_to:  # the same front and cluster, built by this script so it can profile the loop thread
            cmd = [sys.executable, __file__, "--serve-profiled", profile_to, str(model_dir), str(self.port)]
        # stderr to a file: a pipe nobody drains would block the server once it fills
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"server exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise SystemExit("server did not start")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def errors(self) -> str:
        self.log.seek(0)
        return "\n".join(ln for ln in self.log.read().decode(errors="replace").splitlines() if "Error" in ln)

    def stop(self) -> None:
        if self.errors():
            print(f"server errors:\n{self.errors()[-2000:]}")
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def raw_request(port: int, prompt: str, max_tokens: int) -> bytes:
    """A streaming POST /v1/completions as bytes (Connection: close). The clients here
    speak HTTP/1.1 on plain sockets, so the client's own CPU stays small next to the
    server's (httpx's async streaming cost more CPU than the server on this machine)."""
    payload = json.dumps(body(prompt, max_tokens)).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload


def http_ttft(port: int, prompt: str, max_tokens: int) -> float:
    """Seconds from sending the request to the first SSE frame; then reads to the end."""
    t0 = time.perf_counter()
    ttft = None
    buf = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(raw_request(port, prompt, max_tokens))
        while True:
            data = s.recv(65536)
            if not data:
                break
            if ttft is None:
                buf += data
                if b"data: " in buf:
                    ttft = time.perf_counter() - t0
            elif b"data: [DONE]" in data:
                pass
        if ttft is None or b" 200 " not in buf.split(b"\r\n", 1)[0]:
            raise SystemExit(f"bad response: {buf[:300]!r}")
    return ttft


def direct_ttft(cluster, ids: list[int], params) -> float:
    t0 = time.perf_counter()
    it = iter(cluster.submit(ids, params))
    next(it)
    ttft = time.perf_counter() - t0
    for _ in it:
        pass
    return ttft


async def http_load(port: int, ps: list[str], concurrency: int, max_tokens: int) -> tuple[float, int]:
    """``concurrency`` clients, each streaming requests back to back; (seconds, SSE frames)."""
    q: asyncio.Queue[str] = asyncio.Queue()
    for p in ps:
        q.put_nowait(p)
    frames = 0

    async def worker() -> None:
        nonlocal frames
        while not q.empty():
            p = q.get_nowait()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw_request(port, p, max_tokens))
            data = await reader.read()  # to EOF: the server closes after [DONE]
            writer.close()
            if b"data: [DONE]" not in data:
                raise SystemExit(f"incomplete stream: {data[:300]!r}")
            frames += data.count(b"data: {")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, frames


def direct_load(cluster, ids: list[list[int]], params, concurrency: int) -> float:
    it = iter(ids)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return
            for _ in cluster.submit(p, params):
                pass
    ts = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def profile_summary(path: str, top: int = 14) -> None:
    st = pstats.Stats(path)
    groups: dict[str, float] = {}
    total = 0.0
    rows = []
    for (file, line, fn), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        total += tt
        f = file.replace("\\", "/")
        if "mooncake_rs/http" in f:
            g = "mooncake_rs.http (front)"
        elif "mooncake_rs/text" in f:
            g = "mooncake_rs.text (detokenize, stop strings)"
        elif "mooncake_rs/serving" in f or "mooncake_rs/engine" in f:
            g = "mooncake_rs.serving (submit, handle)"
        elif "/h11/" in f or "uvicorn" in f:
            g = "uvicorn (httptools or h11: parsing, writes)"
        elif "starlette" in f or "anyio" in f:
            g = "starlette / anyio"
        elif "/json/" in f:
            g = "json"
        elif "asyncio" in f or "concurrent/futures" in f or "threading" in f or "selectors" in f:
            g = "asyncio loop, queues, threads, select"
        elif fn.startswith("<"):
            g = "C calls: " + fn
        else:
            g = "other Python"
        groups[g] = groups.get(g, 0.0) + tt
        rows.append((tt, f"{Path(file).name}:{line} {fn}"))
    print(f"front event-loop thread: {total:.2f} s of CPU (cProfile, thread time), by part:")
    merged: dict[str, float] = {}
    for g, tt in groups.items():
        key = g if not g.startswith("C calls: ") or tt / total >= 0.03 else "C calls (other)"
        merged[key] = merged.get(key, 0.0) + tt
    for g, tt in sorted(merged.items(), key=lambda x: -x[1]):
        if tt / total >= 0.01:
            print(f"  {100 * tt / total:5.1f}%  {g}")
    print("top functions by own time:")
    for tt, name in sorted(rows, reverse=True)[:top]:
        print(f"  {100 * tt / total:5.1f}%  {name}")


def serve_profiled(out: str, model_dir: str, port: int) -> None:
    """The front as ``mooncake-rs serve`` builds it, plus two bench-only routes that start
    and stop a cProfile of the event-loop thread (CPU time of that thread only)."""
    import cProfile

    import uvicorn

    from mooncake_rs.serving import Cluster
    from mooncake_rs.http import Frontend, create_app

    prof = cProfile.Profile(time.thread_time)
    cluster = Cluster(model_dir, prefill=2, decode=1, seed=0, prefix_reuse=False)
    app = create_app(Frontend.from_model_dir(cluster, model_dir))

    async def with_switch(scope, receive, send):
        if scope["type"] == "http" and scope["path"] in ("/__bench/start", "/__bench/stop"):
            if scope["path"].endswith("start"):
                prof.enable()
            else:
                prof.disable()
                prof.dump_stats(out)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await app(scope, receive, send)

    try:
        uvicorn.run(with_switch, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        cluster.close()


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-profiled":
        serve_profiled(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ttft-prompts", type=int, default=40)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--processes", action="store_true",
                    help="both clusters run one worker process per instance (the front then has its process's "
                         "GIL to itself and the router)")
    args = ap.parse_args()

    from mooncake_rs.serving import Cluster
    from mooncake_rs.engine import SamplingParams
    from mooncake_rs.text import Tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="mooncake-http-bench-"))
    model_dir = th.write_model_dir(tmp / MODEL)
    tok = Tokenizer.from_dir(model_dir)
    mode = "worker processes" if args.processes else "instances as threads"
    print(f"tiny chat model (vocab {tok.vocab_size}), prefill 2 + decode 1 ({mode}), CPU; noisy shared 2-core VM")

    server = Server(model_dir, extra=("--processes",) if args.processes else ())
    cluster = Cluster(str(model_dir), prefill=2, decode=1, seed=0, prefix_reuse=False, processes=args.processes)
    try:
        params1 = SamplingParams(max_tokens=4, ignore_eos=True)
        ps = prompts(args.ttft_prompts, 1)
        for p in prompts(6, 99):  # warm both sides
            http_ttft(server.port, p, 4)
            direct_ttft(cluster, tok.encode(p), params1)
        h, d = [], []
        for i, p in enumerate(ps):  # alternate which side goes first
            ids = tok.encode(p)
            if i % 2:
                h.append(http_ttft(server.port, p, 4))
                d.append(direct_ttft(cluster, ids, params1))
            else:
                d.append(direct_ttft(cluster, ids, params1))
                h.append(http_ttft(server.port, p, 4))
        mh, md = statistics.median(h), statistics.median(d)
        print(f"\n== TTFT, one request at a time, {len(ps)} prompts of 13-31 tokens, 4 output tokens")
        print(f"{'path':<34} {'p50 ms':>8} {'p90 ms':>8}")
        q90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
        print(f"{'Cluster.submit (in process)':<34} {1e3 * md:8.2f} {1e3 * q90(d):8.2f}")
        print(f"{'HTTP stream (/v1/completions)':<34} {1e3 * mh:8.2f} {1e3 * q90(h):8.2f}")
        print(f"HTTP / direct p50: {mh / md:.2f}x  (+{1e3 * (mh - md):.2f} ms)")

        load = prompts(args.requests, 2)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        load_ids = [tok.encode(p) for p in load]
        cpu0, client0 = server.cpu_s(), time.process_time()
        wall_h, chunks = asyncio.run(http_load(server.port, load, args.concurrency, args.max_tokens))
        cpu_h, cpu_client = server.cpu_s() - cpu0, time.process_time() - client0
        c0 = time.process_time()
        wall_d = direct_load(cluster, load_ids, params, args.concurrency)
        cpu_d = time.process_time() - c0
        print(f"\n== {args.requests} requests, {args.concurrency} concurrent streams, {args.max_tokens} tokens each")
        print(f"{'path':<34} {'req/s':>8} {'tok/s':>8} {'CPU s/req':>10}")
        print(f"{'Cluster.submit (64 threads)':<34} {args.requests / wall_d:8.1f} "
              f"{args.requests * args.max_tokens / wall_d:8.0f} {cpu_d / args.requests:10.4f}")
        print(f"{'HTTP streams (socket client)':<34} {args.requests / wall_h:8.1f} "
              f"{args.requests * args.max_tokens / wall_h:8.0f} {cpu_h / args.requests:10.4f}")
        print(f"HTTP / direct req/s: {wall_d / wall_h:.2f}x; server process CPU (front + its cluster) "
              f"{cpu_h:.1f} s for {args.requests} requests in {wall_h:.1f} s; the client's CPU "
              f"{cpu_client:.1f} s; {chunks} SSE chunks")
    finally:
        server.stop()
        cluster.close()

    if not args.no_profile:
        prof = str(tmp / "front.prof")
        server = Server(model_dir, profile_to=prof)
        try:
            asyncio.run(http_load(server.port, prompts(16, 4), 16, args.max_tokens))  # warm-up, not profiled
            httpx.post(server.url + "/__bench/start")
            asyncio.run(http_load(server.port, prompts(min(args.requests, 128), 3), args.concurrency, args.max_tokens))
            httpx.post(server.url + "/__bench/stop")
        finally:
            server.stop()
        print(f"\n== where the front's CPU goes ({min(args.requests, 128)} requests, {args.concurrency} streams)")
        profile_summary(prof)


if __name__ == "__main__":
    main()
