"""benches/gpu_check.py's verdict logic and CPU paths (no CUDA needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exit_code_is_nonzero_on_any_fail_or_missed(gc):
    v = gc.Verdicts()
    assert v.exit_code() == (1, "no check ran")
    v.check("accuracy", True)
    v.check("decode bound", True, "1.3x", target=True)
    assert v.exit_code() == (0, "all 2 checks passed")
    assert [w for _, w, _ in v.items] == ["OK", "MET"]
    for failing in (("x", False, "", False), ("y", False, "2.5x", True)):
        w = gc.Verdicts()
        w.check("accuracy", True)
        w.check(failing[0], failing[1], failing[2], target=failing[3])
        rc, msg = w.exit_code()
        assert rc == 1
        assert ("MISSED: y (2.5x)" if failing[3] else "FAIL: x") in msg and "accuracy" not in msg
    w = gc.Verdicts()
    w.record("gpu", "MISSED", "no CUDA device")
    assert w.exit_code() == (1, "1 of 1 checks did not pass:\n  MISSED: gpu (no CUDA device)")
    with pytest.raises(ValueError, match="verdict must be one of"):
        w.record("z", "PASS")
    gc.self_check_verdicts()  # the script's own self-check passes


def test_prefill_flops(gc):
    cfg = gc.ModelConfig.preset("llama-3-8b")
    f = gc.prefill_flops(cfg, 4096, 0)
    matmul = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # input embedding is a lookup
    assert 7.4e9 < matmul < 7.6e9
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (4096 * 4097 / 2)
    assert f == pytest.approx(2 * matmul * 4096 + attn)
    # cached tokens add attention work only
    assert gc.prefill_flops(cfg, 512, 1536) - gc.prefill_flops(cfg, 512, 0) == pytest.approx(
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 512 * 1536)


def _run(args, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_dry_run_passes_and_writes_verdicts(tmp_path):
    r = _run(["--dry-run"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[done] all 2 checks passed" in r.stdout
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["exit_code"] == 0 and {v["verdict"] for v in res["verdicts"]} == {"OK"}
    kv = res["cpu_kv_save"]  # the save path ran (tiny model, 2 requests of 4 blocks)
    # block: 2 layers x (k, v) x 16 tokens x 2 kv heads x head_dim 16 x 4 bytes
    assert kv["bytes"] == 2 * 4 * (2 * 2 * 16 * 2 * 16 * 4) and kv["save_GBps"] > 0 and kv["ratio"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_the_gpu_checks_are_missed(tmp_path):
    r = _run([], tmp_path)
    assert r.returncode == 1
    assert "MISSED: GPU checks (no CUDA device" in r.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["exit_code"] == 1
