"""The README's "Serving over HTTP" commands run as written: ``mooncake-rs serve`` in a
subprocess on a tiny model directory, then the curl line and the openai snippet."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import text_helpers as th  # noqa: E402
from ports import free_port  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.timeout(300)


def _section() -> tuple[list[str], str]:
    text = README.read_text()
    sec = text.split("## Serving over HTTP", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", sec, flags=re.S).group(1).strip().splitlines()
    py = re.search(r"```py\n(.*?)```", sec, flags=re.S).group(1)
    return bash, py


def test_readme_serve_curl_and_openai(tmp_path):
    bash, py = _section()
    serve_line = next(ln for ln in bash if ln.startswith("mooncake-rs serve"))
    curl_line = next(ln for ln in bash if ln.startswith("curl "))
    port = str(free_port())
    args = shlex.split(serve_line.rstrip("&").strip())
    assert args[:2] == ["mooncake-rs", "serve"]
    model_dir = args[args.index("--model") + 1]
    th.write_model_dir(tmp_path / model_dir)
    args[args.index("--port") + 1] = port
    # the same entry point as the installed script, with this interpreter
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs", *args[1:]], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the server did not come up"
            time.sleep(0.2)
        if shutil.which("curl"):
            out = subprocess.run(shlex.split(curl_line.replace("localhost:8000", f"127.0.0.1:{port}")),
                                 capture_output=True, timeout=60, check=True).stdout
            body = json.loads(out)
            assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
        code = py.replace("http://localhost:8000", f"http://127.0.0.1:{port}")
        exec(compile(code, "README.md serve block", "exec"), {})
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down, then the cluster closes
        try:
            assert proc.wait(60) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
