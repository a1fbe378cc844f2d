"""Our interop path in front of a real vLLM (CPU build), in one run:

1. **Event lag**: vLLM publishes KV events while serving concurrent requests; a
   subscriber (our ``KVEventSubscriber`` + Rust ingest into a block index) applies them.
   Lag = when a batch is applied here minus its publication timestamp (the batch's
   ``ts``, vLLM's ``time.time()`` when it published). Target: p99 <= 50 ms.
2. **Added TTFT of ``serve --upstream``**: the same streamed prompts sent to vLLM
   directly and through the proxy, alternating one by one; TTFT = time to the first
   streamed chunk with text. Reported as p50/p99 of each and their difference.

Needs vLLM (``scripts/install-vllm``). Usage::

    python benches/vllm_interop_bench.py [--seconds 30] [--clients 4] [--ttft-prompts 60]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_support import MODEL_NAME, free_port, make_vllm_model, start_vllm  # noqa: E402

from mooncake_rs import PrefixHasher  # noqa: E402
from mooncake_rs.kv_events import Ingestor, MediumIndex  # noqa: E402
from mooncake_rs.kv_events.subscriber import KVEventSubscriber  # noqa: E402


class _Ts(msgspec.Struct, array_like=True):
    ts: float
    events: msgspec.Raw
    rank: msgspec.Raw = msgspec.Raw(b"\xc0")


_ts_of = msgspec.msgpack.Decoder(_Ts).decode


class TimedIngestor(Ingestor):
    """Records, per applied message, now - its publication timestamp, and our own part:
    now - when the subscriber took the message off its socket (``received``)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.lags: list[float] = []
        self.ours: list[float] = []
        self.received = 0.0

    def apply_payload(self, payload):  # type: ignore[override]
        super().apply_payload(payload)
        now = time.time()
        self.lags.append(now - _ts_of(payload).ts)
        self.ours.append(now - self.received)


class TimedSubscriber(KVEventSubscriber):
    def _handle(self, frames):  # type: ignore[override]
        self.ingestor.received = time.time()  # type: ignore[attr-defined]
        super()._handle(frames)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load(server, seconds: float, clients: int) -> int:
    """Closed-loop clients: shared system prefixes + own tails, short outputs. Returns requests done."""
    prefixes = [[random.Random(p).randrange(10, 300) for _ in range(256)] for p in range(4)]
    done = 0
    stop = time.monotonic() + seconds

    def client(c: int) -> int:
        rng = random.Random(c)
        n = 0
        while time.monotonic() < stop:
            ids = prefixes[rng.randrange(4)] + [rng.randrange(10, 300) for _ in range(rng.randrange(16, 300))]
            server.complete(ids, max_tokens=rng.randrange(8, 48))
            n += 1
        return n

    with ThreadPoolExecutor(clients) as ex:
        done = sum(ex.map(client, range(clients)))
    return done


def ttft(url: str, ids: list[int]) -> float:
    body = json.dumps({"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - t0
        assert first is not None, "no streamed token"
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ttft-prompts", type=int, default=60)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vllm-interop-bench-"))
    model = make_vllm_model(work / "model")
    server = start_vllm(model, log_dir=work)
    proxy = None
    try:
        # 1. event lag under load
        ing = TimedIngestor(MediumIndex(), 1, PrefixHasher(server.block_size))
        sub = TimedSubscriber(server.events_endpoint, ing, server.replay_endpoint)
        sub.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        reqs = load(server, args.seconds, args.clients)
        wall = time.monotonic() - t0
        time.sleep(0.5)
        sub.stop()
        lags = [x * 1e3 for x in ing.lags]
        st = ing.stats()
        print(f"event lag under load ({args.clients} clients, {reqs} requests in {wall:.0f} s, "
              f"{len(lags)} messages, {st.stored_blocks} blocks stored, {st.removed_blocks} removed):")
        print(f"  publication -> applied: p50 {pct(lags, 0.5):.2f} ms  p99 {pct(lags, 0.99):.2f} ms  "
              f"max {max(lags):.2f} ms  (target p99 <= 50 ms: {'met' if pct(lags, 0.99) <= 50 else 'MISSED'})")
        ours = [x * 1e3 for x in ing.ours]
        print(f"  of which ours (off the socket -> applied): p50 {pct(ours, 0.5):.3f} ms  "
              f"p99 {pct(ours, 0.99):.3f} ms  max {max(ours):.3f} ms")

        # 2. added TTFT of serve --upstream
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "mooncake_rs", "serve", "--tokenizer", str(model),
                                  "--host", "127.0.0.1", "--port", str(port), "--upstream",
                                  f"v={server.url},events={server.events_endpoint},replay={server.replay_endpoint}"],
                                 stdout=subprocess.DEVNULL, stderr=open(work / "proxy.log", "wb"))
        purl = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(purl + "/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proxy.poll() is not None:
                    raise RuntimeError((work / "proxy.log").read_text()) from None
                time.sleep(0.2)
        rng = random.Random(7)
        direct, proxied = [], []
        for i in range(args.ttft_prompts):
            ids = [rng.randrange(10, 300) for _ in range(rng.randrange(64, 512))]
            # Alternate which goes first, each on its own fresh prompt (no cache hit for either).
            other = [rng.randrange(10, 300) for _ in range(len(ids))]
            pairs = [(server.url, ids, direct), (purl, other, proxied)]
            for url, p, out in (pairs if i % 2 == 0 else pairs[::-1]):
                out.append(ttft(url, p) * 1e3)
        d50, p50 = statistics.median(direct), statistics.median(proxied)
        print(f"TTFT over {args.ttft_prompts} prompts each (streamed, 64-511 tokens, no cache hit):")
        print(f"  vLLM direct      p50 {d50:.2f} ms  p99 {pct(direct, 0.99):.2f} ms")
        print(f"  serve --upstream p50 {p50:.2f} ms  p99 {pct(proxied, 0.99):.2f} ms")
        print(f"  added: p50 +{p50 - d50:.2f} ms ({p50 / d50:.2f}x), "
              f"p99 +{pct(proxied, 0.99) - pct(direct, 0.99):.2f} ms")
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(15)
        server.stop()


if __name__ == "__main__":
    threading.excepthook = lambda a: print("thread failed:", a.exc_value, file=sys.stderr)
    main()
