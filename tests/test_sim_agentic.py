"""The agentic trace generator: tool loops over a long shared context."""

from __future__ import annotations

import pytest

from mooncake_rs import InvalidArgument
from mooncake_rs.sim import BLOCK_TOKENS, generate_trace, hit_rate_curve


def test_chat_is_the_default_and_unchanged():
    assert generate_trace(200, seed=4) == generate_trace(200, seed=4, kind="chat")


def test_agentic_is_deterministic_sorted_and_reuses_90_to_99_percent():
    a = generate_trace(1500, kind="agentic", rate=1.0, seed=9)
    assert a == generate_trace(1500, kind="agentic", rate=1.0, seed=9)
    assert a != generate_trace(1500, kind="agentic", rate=1.0, seed=10)
    assert len(a) == 1500
    assert all(x.timestamp_ms <= y.timestamp_ms for x, y in zip(a, a[1:]))
    hit = hit_rate_curve(a, [10**12])[10**12]
    assert 0.90 <= hit <= 0.99
    # short outputs, long prompts
    assert max(r.output_length for r in a) <= 256
    assert sum(r.input_length for r in a) / len(a) > 8192


def test_each_step_extends_the_previous_one():
    tr = generate_trace(300, kind="agentic", rate=0.05, seed=1, agents=1, tool_calls=(6, 6), tool_latency_s=0.5)
    # steps of one task: every prompt's full blocks start with the previous prompt's
    steps = sorted(tr, key=lambda r: r.timestamp_ms)
    chains = 0
    for prev in steps:
        nxt = [r for r in steps if r.timestamp_ms > prev.timestamp_ms and r.hash_ids[: len(prev.full_blocks())] == prev.full_blocks() and r.input_length > prev.input_length]
        if nxt:
            chains += 1
            n = nxt[0]
            assert n.input_length >= prev.input_length + prev.output_length + 64
    assert chains >= len(tr) * 0.7
    # one agent: every prompt starts with the same shared context
    first = tr[0].full_blocks()[: 8192 // BLOCK_TOKENS]
    assert all(r.full_blocks()[: len(first)] == first for r in tr)


def test_max_context_stops_a_task():
    tr = generate_trace(500, kind="agentic", seed=3, max_context_tokens=40_000)
    assert max(r.input_length for r in tr) <= 40_000


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind="batch"),
        dict(kind="agentic", agents=0),
        dict(kind="agentic", tool_calls=(0, 3)),
        dict(kind="agentic", tool_result_tokens=(10, 5)),
        dict(kind="agentic", tool_latency_s=-1.0),
        dict(kind="agentic", max_context_tokens=0),
    ],
)
def test_bad_agentic_arguments(kw):
    with pytest.raises(InvalidArgument):
        generate_trace(10, **kw)
