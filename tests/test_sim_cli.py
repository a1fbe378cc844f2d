"""`mooncake-rs replay` end to end on a tiny generated trace."""

from __future__ import annotations

import json

import pytest

from mooncake_rs.cli import main
from mooncake_rs.sim import generate_trace


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.jsonl"
    generate_trace(60, seed=1, rate=20.0, path=p)
    return p


def test_replay_writes_report_and_plot(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", str(tiny), "--prefill", "2", "--decode", "2", "--policy", "mooncake", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["requests"] == 60 and doc["config"]["policy"] == "mooncake"
    assert png.stat().st_size > 1000
    assert "mooncake" in capsys.readouterr().out


def test_replay_sweep_policy_prints_a_table(tiny, capsys):
    assert main(["replay", str(tiny), "--prefill", "2", "--decode", "2", "--sweep", "policy", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for p in ("random", "load_balance", "local_cache_aware", "mooncake", "ttft_optimal"):
        assert p in text
    assert "eff. capacity" in text


def test_replay_bad_trace_exits_2(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n{oops\n')
    assert main(["replay", str(p), "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_replay_bad_option_exits_2(tiny, capsys):
    assert main(["replay", str(tiny), "--policy", "nope", "--no-progress"]) == 2
    assert "policy" in capsys.readouterr().err
