import subprocess
import sys

from mooncake_rs.cli import main
from mooncake_rs.workload import ChatWorkload, generate_chat_workload

import pytest

from mooncake_rs import InvalidArgument


def test_index_demo_runs_and_cache_aware_routing_wins(capsys):
    assert main(["demo", "--index-only", "--conversations", "30", "--turns", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "prefix hit rate" in out
    # The demo's own numbers: cache-aware routing beats random overall.
    from mooncake_rs import demo

    r_random, r_aware = demo.run(conversations=30, turns=3, progress=False)
    assert r_aware.rate() > r_random.rate()
    assert sum(r_aware.requests.values()) == sum(r_random.requests.values()) == 90


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "mooncake_rs", "version"], check=True, capture_output=True, text=True)
    assert out.stdout.strip()


def test_workload_is_deterministic_and_prefix_shaped():
    cfg = ChatWorkload(conversations=5, turns=3, seed=4)
    a, b = generate_chat_workload(cfg), generate_chat_workload(cfg)
    assert a == b
    by_conv = {}
    for r in a:
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt
    with pytest.raises(InvalidArgument):
        ChatWorkload(turns=0)


def test_cluster_demo_is_the_default(capsys):
    pytest.importorskip("torch")
    assert main(["demo", "--conversations", "3", "--turns", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "2 prefill + 1 decode" in out
    assert "TTFT  p50" in out and "TBT   p50" in out and "prefix hit rate" in out
    assert "== prefix reuse: 6/6 requests" in out and "== no prefix reuse: 6/6 requests" in out
    assert "reused 0 tokens" in out  # the run without reuse reuses nothing
