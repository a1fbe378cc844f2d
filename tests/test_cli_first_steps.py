"""A new user's first commands (issue 27): ``make-model`` writes a directory ``serve``
takes, ``serve --model tiny`` has a front for the preset, a bad model directory or a
missing extra is one line saying what to do (before anything starts), and ``trace``
writes what ``replay`` reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_rs.cli import main


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err  # a reason, not a traceback
    return lines[0]


def test_make_model_writes_a_directory_serve_and_the_engine_take(tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    from mooncake_rs.base.model_config import model_dir_config
    from mooncake_rs.text import Tokenizer

    d = tmp_path / "tiny"
    assert main(["make-model", str(d), "--seed", "3"]) == 0
    assert {p.name for p in d.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                             "tokenizer_config.json"}
    cfg = model_dir_config(d)
    tok = Tokenizer.from_dir(d)
    assert cfg.vocab_size == tok.vocab_size
    ids = tok.encode_chat([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert all(0 <= i < cfg.vocab_size for i in ids)
    # the same maker the tests use, so the same seed gives the same bytes
    from mooncake_rs.models.tiny import write_model_dir

    again = write_model_dir(tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()


def test_a_bad_model_directory_is_one_line_before_anything_starts(tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("uvicorn")
    from mooncake_rs.models.tiny import write_model_dir

    full = write_model_dir(tmp_path / "full")
    d = tmp_path / "d"
    d.mkdir()
    assert main(["serve", "--model", str(d)]) == 2
    assert "no config.json" in _one_line(capsys.readouterr().err)
    (d / "config.json").write_bytes((full / "config.json").read_bytes())
    assert main(["serve", "--model", str(d)]) == 2
    assert "safetensors" in _one_line(capsys.readouterr().err)
    (d / "model.safetensors").write_bytes((full / "model.safetensors").read_bytes())
    assert main(["serve", "--model", str(d)]) == 2
    assert "tokenizer.json" in _one_line(capsys.readouterr().err)
    assert main(["serve", "--model", "no-such-preset"]) == 2
    assert "make-model" in _one_line(capsys.readouterr().err)


def test_a_preset_gets_a_byte_level_front(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from mooncake_rs.base.model_config import PRESETS
    from mooncake_rs.http.front import Frontend
    from mooncake_rs.models.tiny import front_dir
    from mooncake_rs.text import Tokenizer

    d = front_dir("tiny", tmp_path)
    tok = Tokenizer.from_dir(d)
    assert tok.vocab_size == PRESETS["tiny"].vocab_size == 256
    text = "héllo 日本 😀"
    assert tok.decode(tok.encode(text)) == text
    assert sorted(tok.encode(text)) != []  # every byte is one id below 256
    front = Frontend.from_model_dir(object(), d, model_name="tiny")
    assert front.max_model_len == PRESETS["tiny"].max_position_embeddings


@pytest.mark.parametrize(("argv", "blocked", "extra"), [
    (["serve", "--model", "tiny"], "uvicorn", "mooncake-rs[torch,http]"),
    (["replay", "no-such-trace.jsonl", "--plot", "out.png"], "matplotlib", "mooncake-rs[plot]"),
    (["make-model", "unused-dir"], "safetensors", "mooncake-rs[torch,http]"),
])
def test_a_missing_extra_is_one_line_before_the_run(argv: list[str], blocked: str, extra: str, tmp_path: Path) -> None:
    # the module is made unimportable in a child (as if not installed); the command must
    # say what to install before it reads its input or starts anything
    code = (f"import sys; sys.modules[{blocked!r}] = None; from mooncake_rs.cli import main; "
            f"sys.exit(main({argv!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = _one_line(r.stderr)
    assert extra in line and blocked in line
    assert not any(tmp_path.iterdir())  # nothing was written


def test_trace_writes_what_replay_reads(tmp_path: Path, capsys) -> None:
    from mooncake_rs import sim

    out = tmp_path / "t.jsonl"
    assert main(["trace", str(out), "--requests", "40", "--rate", "2", "--seed", "5"]) == 0
    got = sim.load_trace(out)
    want = sim.generate_trace(40, rate=2.0, seed=5)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in got] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in want]
    assert [r.timestamp_ms for r in got] == pytest.approx([r.timestamp_ms for r in want], abs=1e-3)
    assert main(["replay", str(out), "--prefill", "2", "--decode", "2", "--no-progress"]) == 0
