"""Trace I/O, the generator and the hit-rate curve (hand-computed cases)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake_rs import InvalidArgument
from mooncake_rs.sim import Request, generate_trace, hit_rate_curve, load_trace, save_trace

# The public trace lives in shared/ beside the checkout (never copied into the repo).
SYNTHETIC = os.environ.get(
    "MOONCAKE_TRACE",
    str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"),
)


def _line(ts, inp, out, ids):
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def test_load_trace_reads_and_sorts(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(_line(100, 1024, 5, [1, 2]) + "\n\n" + _line(0, 600, 3, [7, 8]) + "\n")
    tr = load_trace(p)
    assert [r.timestamp_ms for r in tr] == [0.0, 100.0]
    assert tr[0] == Request(0.0, 600, 3, (7, 8))
    assert tr[0].full_blocks() == (7,)  # 600 tokens: one full 512-token block
    assert tr[1].arrival_s == pytest.approx(0.1)


@pytest.mark.parametrize(
    "bad, what",
    [
        ("{not json", "not valid JSON"),
        (_line(-1, 10, 1, [1]), "timestamp"),
        (_line(0, 0, 1, []), "input_length"),
        (_line(0, 10, -2, [1]), "output_length"),
        (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}), "hash_ids"),
        (_line(0, 10, 1, [1, 2]), "more blocks"),
        (_line(0, 10, 1, [-5]), "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_line_names_its_number(tmp_path, bad, what):
    p = tmp_path / "t.jsonl"
    p.write_text(_line(0, 512, 1, [1]) + "\n" + _line(1, 512, 1, [2]) + "\n" + bad + "\n")
    with pytest.raises(InvalidArgument, match=r"line 3") as e:
        load_trace(p)
    assert what in str(e.value)


def test_missing_file_is_invalid_argument(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_generate_is_deterministic_and_round_trips(tmp_path):
    a = generate_trace(300, seed=3, path=tmp_path / "a.jsonl")
    b = generate_trace(300, seed=3)
    c = generate_trace(300, seed=4)
    assert a == b and a != c and len(a) == 300
    assert load_trace(tmp_path / "a.jsonl") == a
    ts = [r.timestamp_ms for r in a]
    assert ts == sorted(ts)
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // 512)


def test_generated_conversations_share_prefixes():
    tr = generate_trace(400, seed=1, conversation_share=1.0, turns=(3, 3), think_time_s=1.0, system_prompts=2)
    # later turns extend earlier prompts: many requests start with another's full blocks
    by_head: dict[int, list[Request]] = {}
    for r in tr:
        if r.full_blocks():
            by_head.setdefault(r.full_blocks()[0], []).append(r)
    assert 1 <= len(by_head) <= 2  # every prompt starts with one of the two system prompts
    firsts = {r.full_blocks() for r in tr}
    extended = sum(
        1 for r in tr for q in firsts if len(q) < len(r.full_blocks()) and r.full_blocks()[: len(q)] == q and len(q) > 8
    )
    assert extended > 0


@pytest.mark.parametrize("kind", ["chat", "agentic"])
def test_generated_ids_are_chained(kind):
    """An id stands for its whole prefix (docs/design.md "Hashing"): two prompts that
    share an id at position k share every id before it. Before k25x a long-document
    query's document ids were the same after every system prompt, so a cache holding
    the document after one system prompt served it after another."""
    tr = generate_trace(600, seed=5, kind=kind, system_prompts=3, documents=4, conversation_share=0.3)
    prefix_of: dict[int, tuple[int, int | None]] = {}  # id -> (position, the id before it)
    for r in tr:
        for k, h in enumerate(r.hash_ids):
            seen = (k, r.hash_ids[k - 1] if k else None)
            assert prefix_of.setdefault(h, seen) == seen, f"id {h} follows two different prefixes"
    # documents are still shared: some request reuses another's system prompt and document
    heads = {}
    shared = 0
    for r in tr:
        fb = r.full_blocks()
        if len(fb) > 16:
            shared += heads.get(fb[:16], 0)
            heads[fb[:16]] = 1
    assert shared > 0


def test_bursty_arrivals_are_burstier():
    def cv(tr):
        gaps = [b.timestamp_ms - a.timestamp_ms for a, b in zip(tr, tr[1:])]
        m = sum(gaps) / len(gaps)
        return (sum((g - m) ** 2 for g in gaps) / len(gaps)) ** 0.5 / m

    kw = dict(conversation_share=0.0, rate=5.0, seed=2)
    assert cv(generate_trace(2000, arrival="bursty", burst_factor=8.0, burst_period_s=20.0, **kw)) > cv(
        generate_trace(2000, arrival="poisson", **kw)
    )


def test_generate_rejects_bad_knobs():
    with pytest.raises(InvalidArgument):
        generate_trace(10, arrival="sometimes")
    with pytest.raises(InvalidArgument):
        generate_trace(10, rate=0)
    with pytest.raises(InvalidArgument):
        generate_trace(10, turns=(3, 1))


def _three():
    # A = [1,2,3], B = [1,2,4], C = [1,5]; 512 tokens a block, all full
    return [Request(0, 1536, 1, (1, 2, 3)), Request(1, 1536, 1, (1, 2, 4)), Request(2, 1024, 1, (1, 5))]


def test_hit_rate_curve_by_hand():
    # unbounded: A hits 0, B hits 2 (1,2), C hits 1 (1): 3 of 8 blocks.
    # 3 blocks (LRU): A -> {1,2,3}; B hits 1,2, inserts 4 evicting 3; C hits 1: 3/8.
    # 2 blocks: A leaves {2,3}; B misses 1 at once (0 hits) and leaves {2,4}; C misses: 0.
    got = hit_rate_curve(_three(), [0, 1024, 1536, 10**9], eviction="lru")
    assert got == {0: 0.0, 1024: 0.0, 1536: 0.375, 10**9: 0.375}


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "prefix"])
def test_hit_rate_curve_unbounded_is_policy_independent(policy):
    assert hit_rate_curve(_three(), [10**6], eviction=policy) == {10**6: 0.375}


def test_hit_rate_curve_partial_block_not_counted():
    tr = [Request(0, 700, 1, (1, 2)), Request(1, 700, 1, (1, 2))]
    # one full block each; the second request reuses it: 1 of 2
    assert hit_rate_curve(tr, [10**6]) == {10**6: 0.5}


def test_hit_rate_curve_bad_input():
    with pytest.raises(InvalidArgument):
        hit_rate_curve(_three(), [-1])
    with pytest.raises(InvalidArgument, match="eviction"):
        hit_rate_curve(_three(), [1024], eviction="nope")


@pytest.mark.skipif(not os.path.exists(SYNTHETIC), reason="shared synthetic trace absent")
def test_synthetic_trace_unbounded_cache_ratio():
    tr = load_trace(SYNTHETIC)
    assert len(tr) == 3993
    curve = hit_rate_curve(tr, [10**4, 10**9])
    # the paper's Table 2: 66% on the synthetic trace (full blocks)
    assert 0.64 < curve[10**9] < 0.68
    assert curve[10**4] < curve[10**9]
