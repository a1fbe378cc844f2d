"""``serve --upstream``: what the KV-aware proxy adds per request.

1. Routing: ``UpstreamRouter.route`` + ``first_token`` + ``finish`` for a 4k-token prompt
   (token ids, so no tokenizer) over 8 upstreams whose index holds 12 such prompts each.
2. Over HTTP, side by side in one run (alternating rounds): sequential non-streaming
   completions sent to a model-free OpenAI-shaped engine directly, and the same through
   the proxy (token-id prompts: no tokenizer). The difference is the proxy's cost: one
   more HTTP hop (httpx client + uvicorn server) plus routing.

    python benches/upstream_proxy_bench.py [--requests 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import time

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from mooncake_rs.http.server import ServerThread
from mooncake_rs.http.upstream.proxy import create_proxy_app
from mooncake_rs.interop.upstream import UpstreamRouter, UpstreamSpec


class _Ids:
    def encode(self, text: str) -> list[int]:
        raise AssertionError("the bench sends token ids")

    def encode_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        raise AssertionError("the bench sends token ids")


class _Conn:
    """A keep-alive HTTP/1.1 client that writes each request in one send with TCP_NODELAY:
    httpx's sync client split header and body here and met the 40 ms delayed-ACK stall,
    which would hide the figure we want."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = host
        self.buf = b""

    def post(self, path: str, body: bytes) -> bytes:
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        while len(rest) < n:
            rest += self.sock.recv(65536)
        self.buf = rest[n:]
        return rest[:n]

    def close(self) -> None:
        self.sock.close()


def bench_route(n: int = 2000) -> tuple[float, float]:
    bs, rng = 16, random.Random(0)
    router = UpstreamRouter([UpstreamSpec(f"u{i}", f"http://127.0.0.1:{i + 1}") for i in range(8)],
                            block_size=bs, subscribe=False)
    prompts = [[rng.randrange(32000) for _ in range(4096)] for _ in range(64)]
    for slot in range(8):
        for p in prompts[slot * 8:(slot + 1) * 8] + prompts[:4]:
            router.conductor.index.insert(slot, router.hasher.hash_blocks(p), "dram")
    queries = [prompts[rng.randrange(64)][:3072] + [rng.randrange(32000) for _ in range(1024)] for _ in range(64)]
    times = []
    for i in range(n):
        q = queries[i % len(queries)]
        t0 = time.perf_counter()
        r = router.route(q)
        router.first_token(r)
        router.finish(r, 16)
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e6, times[int(len(times) * 0.99)] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    p50, p99 = bench_route()
    print(f"route+first_token+finish, 4k-token prompt, 8 upstreams x 12 prompts: p50 {p50:.0f} us, p99 {p99:.0f} us")

    async def completions(request):  # type: ignore[no-untyped-def]
        await request.body()
        return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    engine = ServerThread(None, app=Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]))
    engine.start()
    router = UpstreamRouter([UpstreamSpec("e", engine.url)], block_size=16, subscribe=False)
    proxy = ServerThread(None, app=create_proxy_app(router, _Ids())).start()
    body = json.dumps({"model": "m", "prompt": list(range(512)), "max_tokens": 1}).encode()
    rows = []
    conns = {"direct": _Conn(engine.url), "proxy": _Conn(proxy.url)}
    try:
        for c in conns.values():  # warm both paths
            for _ in range(20):
                c.post("/v1/completions", body)
        for rnd in range(args.rounds):
            got = {}
            for label, c in conns.items():
                lat = []
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    c.post("/v1/completions", body)
                    lat.append(time.perf_counter() - t0)
                got[label] = statistics.median(lat) * 1e3
            rows.append(got)
            print(f"round {rnd + 1}: direct p50 {got['direct']:.2f} ms, via proxy p50 {got['proxy']:.2f} ms, "
                  f"ratio {got['proxy'] / got['direct']:.2f}x, added {got['proxy'] - got['direct']:.2f} ms")
    finally:
        for c in conns.values():
            c.close()
        proxy.stop()
        engine.stop()
    d = statistics.median(r["direct"] for r in rows)
    p = statistics.median(r["proxy"] for r in rows)
    print(f"median of rounds: direct {d:.2f} ms, via proxy {p:.2f} ms ({p / d:.2f}x, +{p - d:.2f} ms)")


if __name__ == "__main__":
    main()
