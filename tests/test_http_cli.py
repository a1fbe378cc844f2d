"""``mooncake-rs serve`` refuses bad arguments with what to fix, before starting anything;
the core package and the CLI parser import without the http extra's libraries."""

from __future__ import annotations

import subprocess
import sys

from mooncake_rs.cli import main


def test_serve_refuses_etcd_and_bad_model_dirs(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path), "--etcd", "http://127.0.0.1:2379"]) == 2
    assert "--etcd" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path)]) == 2  # no config.json
    assert "config.json" in capsys.readouterr().err


def test_core_imports_without_the_http_stack():
    code = ("import sys, mooncake_rs, mooncake_rs.cli; mooncake_rs.cli.build_parser(); "
            "bad = [m for m in ('starlette', 'uvicorn', 'tokenizers', 'jinja2', 'fastapi') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
