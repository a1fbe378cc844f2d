"""``mooncake-rs replay`` with the fidelity and link options."""

from __future__ import annotations

import json

from mooncake_rs.cli import main
from mooncake_rs.sim import generate_trace, save_trace


def test_replay_with_links_and_ssd(tmp_path):
    tr = tmp_path / "agentic.jsonl"
    save_trace(generate_trace(120, kind="agentic", rate=1.0, seed=3), tr)
    out = tmp_path / "r.json"
    rc = main(
        [
            "replay", str(tr), "--prefill", "2", "--decode", "2", "--capacity-tokens", "16384",
            "--ssd-capacity-tokens", "1000000", "--nic-bandwidth", "2e10", "--storage-bandwidth", "1e10",
            "--multipath", "--estimate-error", "0.2", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["multipath"] is True and doc["config"]["estimate_error"] == 0.2
    assert doc["summary"]["bytes_ssd_direct"] + doc["summary"]["bytes_ssd_relay"] > 0
    assert 0 < doc["summary"]["io_wait_fraction"] < 1


def test_replay_without_the_new_options_reads_as_before(tmp_path):
    tr = tmp_path / "chat.jsonl"
    save_trace(generate_trace(60, seed=1, rate=20.0), tr)
    out = tmp_path / "r.json"
    assert main(["replay", str(tr), "--prefill", "2", "--decode", "2", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    for k in ("estimate_error", "nic_bandwidth", "storage_bandwidth", "ssd_capacity_tokens_per_instance", "multipath"):
        assert k not in doc["config"]
    assert "io_wait_fraction" not in doc["summary"]
