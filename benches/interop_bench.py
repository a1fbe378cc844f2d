"""KV events in and the indexer API: where the time goes.

1. Ingest: blocks/s from one ZMQ stream (a publisher process on 127.0.0.1) into the
   per-medium block index, end to end (recv + decode + hash recomputation + hash map +
   index insert), and each stage alone on the same payloads in this process; the
   reference row decodes the same payloads with the generic ``msgpack`` package. Two
   paths, alternated in the same run: the Rust one (``Ingestor.apply_payload``: one
   ``_core.EventIngestor`` call per message) and the Python reference
   (``Ingestor(reference=True)``: ``decode_payload`` + ``ReferenceIngestor``, what
   ingestion was before). Target: >= 1M blocks/s.
2. ``/query`` for a 4k-token prompt (256 blocks of 16) against 64 instances each holding
   ``--blocks-per-instance`` blocks: p50/p99 of ``Indexer.query`` and of HTTP through
   uvicorn + httpx on 127.0.0.1.

    python benches/interop_bench.py [--blocks 2000000] [--reps 3] [--blocks-per-instance 1000000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import statistics
import threading
import time

import numpy as np

BS = 16


def make_payloads(
    total_blocks: int, blocks_per_event: int, events_per_batch: int, salt: bool = False, seed: int = 0
) -> list[bytes]:
    """Batches of BlockStored events, each event chained on the previous one's last block.
    ``salt``: each sequence's first event carries vLLM's ``extra_keys`` of a request with a
    ``cache_salt`` (the salt on its first block, nil after)."""
    from mooncake_rs.kv_events import BlockStored, encode_batch

    rng = np.random.default_rng(seed)
    per_batch = blocks_per_event * events_per_batch
    n_batches = total_blocks // per_batch
    next_hash = 1
    payloads = []
    for b in range(n_batches):
        events = []
        parent = None
        for e in range(events_per_batch):
            if e % 8 == 0:
                parent = None  # a new sequence now and then
            toks = rng.integers(0, 150_000, blocks_per_event * BS).tolist()
            hashes = list(range(next_hash, next_hash + blocks_per_event))
            next_hash += blocks_per_event
            extra_keys = [[f"tenant-{b % 7}"]] + [None] * (blocks_per_event - 1) if salt and parent is None else None
            events.append(BlockStored(hashes, parent, toks, BS, None, "GPU", None, extra_keys))
            parent = hashes[-1]
        payloads.append(encode_batch(events, ts=float(b), dp_rank=0))
    return payloads


def _publisher(port: int, args: tuple[int, int, int, bool], conn) -> None:  # type: ignore[no-untyped-def]
    import zmq

    payloads = make_payloads(*args)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # unlimited: the benchmark measures the consumer
    pub.bind(f"tcp://127.0.0.1:{port}")
    conn.send("bound")
    pub.recv()  # a subscriber joined
    seq = 0
    while conn.recv() != "done":  # a phase: the whole stream once more, sequence numbers going on
        for p in payloads:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), p])
            seq += 1
    pub.close(0)
    ctx.term()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_cpu0 = [0.0]


def rate(blocks: int, seconds: float) -> str:
    """Wall-clock rate, and this process's CPU time since the stage started (``mark()``):
    on a loaded machine wall time also counts other processes' turns."""
    cpu = time.process_time() - _cpu0[0]
    return f"{blocks / seconds / 1e6:6.2f} M blocks/s ({seconds * 1e3:7.1f} ms wall, {cpu * 1e3:7.1f} ms cpu)"


def mark() -> float:
    _cpu0[0] = time.process_time()
    return time.perf_counter()


def bench_ingest(
    total: int, per_event: int, per_batch: int, hash_name: str, reps: int = 2, salt: bool = False, stages: bool = True
) -> None:
    import zmq

    from mooncake_rs import PrefixHasher, Xxh3RollingHasher
    from mooncake_rs._core import msgpack_tokens
    from mooncake_rs import BlockIndex
    from mooncake_rs.kv_events import Ingestor, MediumIndex, decode_payload
    from mooncake_rs.kv_events.hashmap import DictEngineHashMap
    from mooncake_rs.kv_events.subscriber import KVEventSubscriber

    payloads = make_payloads(total, per_event, per_batch, salt)
    blocks = len(payloads) * per_event * per_batch
    mk_hasher = (lambda: Xxh3RollingHasher(BS)) if hash_name == "rfc" else (lambda: PrefixHasher(BS))
    print(f"\n== ingest: {blocks:,} blocks in {len(payloads):,} batches of {per_batch} events x {per_event} blocks "
          f"(block_size {BS}, {statistics.fmean(map(len, payloads)) / 1024:.1f} KiB/batch), hash={hash_name}"
          + (", salted sequences (extra_keys)" if salt else ""))

    if stages:
        import msgpack  # the reference decoder row (not a dependency of the package)

        # Stages alone, in this process, on the same payloads.
        t = mark()
        for p in payloads:
            msgpack.unpackb(p)
        print(f"  reference: msgpack.unpackb, generic objects   {rate(blocks, time.perf_counter() - t)}")
        t = mark()
        batches = [decode_payload(p) for p in payloads]
        print(f"  decode_payload (typed, token ints)          {rate(blocks, time.perf_counter() - t)}")
        del batches
        t = mark()
        rbatches = [decode_payload(p, raw_tokens=True) for p in payloads]
        t_dec = time.perf_counter() - t
        print(f"  decode_payload(raw_tokens=True)             {rate(blocks, t_dec)}")
        events = [e for b in rbatches for e in b.events]
        t = mark()
        toks = [memoryview(msgpack_tokens(e.token_ids)).cast("I") for e in events]
        t_tok = time.perf_counter() - t
        print(f"  token_ids msgpack -> u32 in Rust            {rate(blocks, t_tok)}")
        hasher = mk_hasher()
        t = mark()
        ours_all = []
        last: dict[int, int] = {}
        for e, tk in zip(events, toks):
            parent = None if e.parent_block_hash is None else last[e.parent_block_hash]
            ours = hasher.hash(tk, parent)
            last[e.block_hashes[-1]] = ours[-1]
            ours_all.append(ours)
        t_hash = time.perf_counter() - t
        print(f"  hash recomputation (hasher.hash per event)  {rate(blocks, t_hash)}")
        del toks
        m = DictEngineHashMap(blocks + 1)
        t = mark()
        for e, ours in zip(events, ours_all):
            m.store(e.block_hashes, ours, 1)
        t_map = time.perf_counter() - t
        print(f"  engine hash map (DictEngineHashMap.store)   {rate(blocks, t_map)}")
        idx = BlockIndex()
        t = mark()
        for ours in ours_all:
            idx.insert(1, ours)
        t_idx = time.perf_counter() - t
        print(f"  BlockIndex.insert                           {rate(blocks, t_idx)}")
        del idx, m, ours_all, last
        target = MediumIndex()
        ing = Ingestor(target, 1, mk_hasher(), map_capacity=blocks + 1, reference=True)
        t = mark()
        for b in rbatches:
            ing.apply(b)
        t_apply = time.perf_counter() - t
        print(f"  reference Ingestor.apply (hash + map + insert) {rate(blocks, t_apply)}")
        for rep in range(reps):
            for ref in (True, False):
                ing2 = Ingestor(MediumIndex(), 1, mk_hasher(), map_capacity=blocks + 1, reference=ref)
                t = mark()
                for p in payloads:
                    ing2.apply_payload(p)
                name = "reference: decode_payload + apply" if ref else "Rust: apply_payload (1 call/msg) "
                print(f"  {name}, no socket  {rate(blocks, time.perf_counter() - t)}")
                del ing2
        del ing, target, rbatches, events

    # End to end over ZMQ from another process: the stream once for recv alone, then
    # once per path and rep, alternating (reference, Rust, reference, Rust, ...).
    port = _free_port()
    ctxm = mp.get_context("spawn")
    parent_conn, child_conn = ctxm.Pipe()
    proc = ctxm.Process(target=_publisher, args=(port, (total, per_event, per_batch, salt), child_conn), daemon=True)
    proc.start()
    try:
        assert parent_conn.poll(120) and parent_conn.recv() == "bound"
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", Ingestor(MediumIndex(), 1, mk_hasher()), rcvhwm=0)
        time.sleep(0.5)  # let the subscription reach the publisher
        raw = sub._sub
        parent_conn.send("recv-only")
        t = mark()
        for _ in range(len(payloads)):
            raw.recv_multipart()
        t_recv = time.perf_counter() - t
        print(f"  ZMQ recv_multipart only                     {rate(blocks, t_recv)}")
        last = len(payloads) - 1  # the recv-only phase's last sequence number
        e2e: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps):
            for ref in (True, False):
                target = MediumIndex()
                ing = Ingestor(target, 1, mk_hasher(), map_capacity=blocks + 1, reference=ref)
                sub.ingestor = ing
                sub._last = sub._sub_last = last  # the stream goes on from there: no gap, no reset
                sub.stats = type(sub.stats)()
                parent_conn.send("ingest")
                t = mark()
                while sub.stats.messages < len(payloads):
                    # at most what is left: poll() otherwise waits out its timeout after the
                    # last message, and the end-to-end time would round up to whole seconds
                    sub.poll(1.0, max_messages=len(payloads) - sub.stats.messages)
                t_e2e = time.perf_counter() - t
                last += len(payloads)
                st = ing.stats()
                assert st.stored_blocks == blocks and sub.stats.gaps == 0 and sub.stats.malformed == 0, (st, sub.stats)
                e2e[ref].append(blocks / t_e2e)
                name = "reference (Python decode + ingest)" if ref else "Rust (apply_payload)              "
                print(f"  END TO END {name} {rate(blocks, t_e2e)}   (target >= 1M blocks/s)")
                del ing, target
        med = {k: statistics.median(v) / 1e6 for k, v in e2e.items()}
        print(f"  end to end, median of {reps}: Rust {med[False]:.2f} M blocks/s, reference {med[True]:.2f} "
              f"M blocks/s, ratio {med[False] / med[True]:.2f}x")
        if stages:
            share = {"recv": t_recv, "decode": t_dec, "tokens": t_tok, "hash": t_hash, "hash map": t_map,
                     "index insert": t_idx}
            tot = sum(share.values())
            print("  time share of the reference stages: " + ", ".join(f"{k} {v / tot:.0%}" for k, v in share.items()))
        sub.stop()
    finally:
        parent_conn.send("done")
        proc.join(10)


def _http_calls(port: int, body: dict[str, object], calls: int) -> list[float]:
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
        deadline = time.monotonic() + 20
        while True:
            try:
                c.get("/health")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        for _ in range(20):
            c.post("/query", json=body)
        lat = []
        for _ in range(calls):
            t = time.perf_counter()
            r = c.post("/query", json=body)
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200
    return lat


def _http_client(port: int, body: dict[str, object], calls: int, conn) -> None:  # type: ignore[no-untyped-def]
    conn.send(_http_calls(port, body, calls))


def bench_query(instances: int, per_instance: int, calls: int) -> None:
    import uvicorn

    from mooncake_rs.interop.http import create_app
    from mooncake_rs.interop.indexer import Indexer
    from mooncake_rs.interop.indexer_api import QueryRequest, RegisterRequest

    print(f"\n== /query: 4096-token prompt ({4096 // BS} blocks of {BS}) against {instances} instances "
          f"x {per_instance:,} blocks")
    indexer = Indexer(subscribe=False)
    for i in range(instances):
        indexer.register(RegisterRequest("tcp://127.0.0.1:1", "vLLM", "m", f"inst-{i}", BS, 0))
    group = next(iter(indexer._groups.values()))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, 4096).tolist()
    phashes = group.hasher.hash(prompt)
    gpu, cpu = group.media.indexes["GPU"], group.media.indexes["CPU"]
    t = time.perf_counter()
    for i, m in enumerate(sorted(group.members.values(), key=lambda m: m.slot)):
        # Instance i holds a prefix of the prompt of i*4 blocks (some also in CPU), plus filler.
        keep = min(len(phashes), i * 4)
        filler = rng.integers(1, 2**63, per_instance - keep, dtype=np.int64).tolist()
        gpu.insert(m.slot, phashes[:keep] + filler)
        if i % 4 == 0:
            cpu.insert(m.slot, phashes[: keep + 8])
        del filler
    print(f"  built in {time.perf_counter() - t:.1f} s; GPU index {gpu.stats().blocks:,} blocks, "
          f"{gpu.stats().memory_bytes / 2**30:.2f} GiB")
    req = QueryRequest("m", BS, prompt)
    ans = indexer.query(req)["default"]
    probe = min(10, instances - 1)
    assert ans[f"inst-{probe}"]["longest_matched"] == min(256, probe * 4) * BS, ans[f"inst-{probe}"]

    def pct(lat: list[float]) -> str:
        lat = sorted(lat)
        return f"p50 {lat[len(lat) // 2] * 1e6:8.1f} us, p99 {lat[int(len(lat) * 0.99)] * 1e6:8.1f} us"

    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        gpu.match_prefix(phashes)
        lat.append(time.perf_counter() - t)
    print(f"  reference: one BlockIndex.match_prefix (GPU)   {pct(lat)}")
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        group.hasher.hash(prompt)
        lat.append(time.perf_counter() - t)
    print(f"  hashing the 4096 tokens                        {pct(lat)}")
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        indexer.query(req)
        lat.append(time.perf_counter() - t)
    print(f"  Indexer.query (hash + 3 media + answer)        {pct(lat)}")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(indexer), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    body = {"model": "m", "block_size": BS, "token_ids": prompt}
    lat = _http_calls(port, body, calls)
    print(f"  HTTP POST /query (uvicorn + httpx, same process) {pct(lat)}")
    ctxm = mp.get_context("spawn")
    parent_conn, child_conn = ctxm.Pipe()
    proc = ctxm.Process(target=_http_client, args=(port, body, calls, child_conn), daemon=True)
    proc.start()
    lat = parent_conn.recv()
    proc.join(30)
    print(f"  HTTP POST /query (client in another process)   {pct(lat)}")
    server.should_exit = True
    th.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2_000_000, help="ingest: blocks published")
    ap.add_argument("--blocks-per-event", type=int, default=32)
    ap.add_argument("--events-per-batch", type=int, default=4)
    ap.add_argument("--hash", choices=["rfc", "mooncake", "both"], default="both")
    ap.add_argument("--reps", type=int, default=2, help="ingest: end-to-end runs per path (alternated)")
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks-per-instance", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--salt", action="store_true", help="ingest: sequences carry a cache_salt in extra_keys")
    ap.add_argument("--skip-stages", action="store_true", help="ingest: end to end only (no per-stage timings)")
    ap.add_argument("--skip-query", action="store_true")
    args = ap.parse_args()
    random.seed(0)
    if not args.skip_ingest:
        for h in (["rfc", "mooncake"] if args.hash == "both" else [args.hash]):
            bench_ingest(args.blocks, args.blocks_per_event, args.events_per_batch, h, args.reps, args.salt,
                         not args.skip_stages)
    if not args.skip_query:
        bench_query(args.instances, args.blocks_per_instance, args.calls)


if __name__ == "__main__":
    main()
