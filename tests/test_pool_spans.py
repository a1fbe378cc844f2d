"""The transfer requests of a remote put/get (planned in Rust: object_layout.rs, through
``_core.plan_object_spans``) against a byte-by-byte reference: every byte of the value
goes to its chunk's slot, once, from the right piece; runs of chunks whose slots follow
each other become one request. And the node hands a re-put object's slots back in
ascending order (segment.py), so those runs happen."""

from __future__ import annotations

import random

import numpy as np

from mooncake_rs.pool.segment import ObjectSegment
from mooncake_rs._core import plan_object_spans as plan_spans


def reference(sizes: list[int], total: int, chunk: int, offsets: list[int]) -> dict[tuple[int, int], int]:
    """(piece, offset in piece) -> remote offset, one byte at a time."""
    out, pos = {}, 0
    for p, n in enumerate(sizes):
        for k in range(min(n, max(0, total - pos))):
            c, within = divmod(pos + k, chunk)
            out[(p, k)] = offsets[c] + within
        pos += n
    return out


def expand(spans: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], int]:
    out = {}
    for p, poff, roff, n in spans:
        for k in range(n):
            assert (p, poff + k) not in out, "a byte moved twice"
            out[(p, poff + k)] = roff + k
    return out


def test_spans_match_the_byte_reference_on_random_layouts():
    rng = random.Random(7)
    for _ in range(400):
        chunk = rng.choice([1, 3, 8, 16])
        total = rng.randint(1, 90)
        nchunks = -(-total // chunk)
        slots = rng.sample(range(nchunks + 6), nchunks)
        if rng.random() < 0.5:
            base = rng.randint(0, 4)
            slots = [base + c for c in range(nchunks)]  # contiguous: must merge
        offsets = [s * chunk for s in slots]
        cuts = sorted(rng.sample(range(1, total + 5), rng.randint(0, 3)))
        edges = [0, *cuts, total + rng.randint(0, 5)]
        sizes = [b - a for a, b in zip(edges, edges[1:]) if b > a]
        spans = plan_spans(sizes, total, chunk, offsets)
        assert expand(spans) == reference(sizes, total, chunk, offsets)
        assert all(n > 0 for *_, n in spans)
        if slots == sorted(slots) and slots == list(range(slots[0], slots[0] + nchunks)):
            used = sum(1 for p, n in enumerate(sizes) if sum(sizes[:p]) < total)
            assert len(spans) == used  # one request per piece


def test_one_request_per_contiguous_object_and_per_chunk_otherwise():
    assert plan_spans([1000], 1000, 256, [0, 256, 512, 768]) == [(0, 0, 0, 1000)]
    assert plan_spans([1000], 1000, 256, [768, 512, 256, 0]) == [(0, 0, 768, 256), (0, 256, 512, 256),
                                                                 (0, 512, 256, 256), (0, 768, 0, 232)]
    # a value larger than asked: only the first `total` bytes
    assert plan_spans([600, 600], 700, 256, [0, 256, 512]) == [(0, 0, 0, 600), (1, 0, 600, 100)]


def test_a_reput_object_gets_ascending_slots_and_its_bytes_stay_its_own():
    seg = ObjectSegment(16 << 20, chunk_bytes=64 << 10)
    vals = {f"k{i}": np.random.default_rng(i).integers(0, 256, 300_000, dtype=np.uint8) for i in range(6)}
    for rnd in range(3):
        reservations = []
        for k, v in vals.items():
            res = seg.reserve(f"{k}-{rnd}", v.nbytes)
            offs = res.offsets
            reservations.append((k, res))
            # ascending and adjacent: one transfer request for the whole object
            assert offs == list(range(offs[0], offs[0] + len(offs) * (64 << 10), 64 << 10)), (rnd, k, offs)
        for _, res in reversed(reservations):
            seg.abort(res)  # (the slots' order is what is checked here; bytes go through put_from below)
        for k, v in vals.items():
            assert seg.put_from(f"{k}-{rnd}", [v.ctypes.data], [v.nbytes]) == 0
        for k, v in vals.items():
            dst = np.zeros_like(v)
            assert seg.get_into(f"{k}-{rnd}", [dst.ctypes.data], [dst.nbytes]) == v.nbytes
            assert np.array_equal(dst, v)
        if rnd == 0:
            for k in vals:
                seg.remove(f"{k}-{rnd}")
        else:
            seg.remove_all()
    seg.check_integrity()


def test_rendezvous_ranking_is_the_keyed_blake2b_order():
    """placement.py's cached keyed hashes give exactly the order of a fresh keyed hash
    per (key, node), the function every client and node version agrees on."""
    import hashlib

    from mooncake_rs.pool.placement import rank_nodes

    def reference(key: str, nodes: list[str]) -> list[str]:
        score = {n: hashlib.blake2b(key.encode(), key=n.encode()[:64], digest_size=8).digest() for n in nodes}
        return sorted(nodes, key=lambda n: (score[n], n), reverse=True)

    rng = random.Random(3)
    for _ in range(300):
        nodes = [f"node-{rng.randint(0, 40)}" + "x" * rng.randint(0, 70) for _ in range(rng.randint(0, 6))]
        key = "".join(rng.choice("abcé/:-0") for _ in range(rng.randint(1, 50)))
        assert rank_nodes(key, nodes) == reference(key, nodes)
