"""Real vLLM servers for tests: a tiny model it loads, and a server started and stopped
as a user would (``python -m vllm.entrypoints.openai.api_server``) in its own process
group.

vLLM is an optional test dependency (``scripts/install-vllm`` puts the CPU build into the
venv; ``.ci/run`` does so and sets ``MOONCAKE_REQUIRE_VLLM=1``, under which a missing
vLLM fails the tests that need it instead of skipping them).

Facts of vLLM 0.32's CPU build this module relies on:
- the PUB socket of KV events binds only when its endpoint holds ``*`` (else it
  connects and nobody receives), so events go out on ``tcp://*:PORT`` and subscribers
  connect to ``tcp://127.0.0.1:PORT``; the replay ROUTER always binds;
- the CPU attention backend needs a block size that is a multiple of 32;
- a start takes ~30 s with ``--enforce-eager`` and ~3 GB of memory, so tests share
  servers (session fixtures in conftest.py) and never run many at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

from ports import free_port  # noqa: F401  (tests import it from here too)

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
MODEL_NAME = "tiny"
"""The name every test server serves its model under (``--served-model-name``)."""
BLOCK_SIZE = 32
START_TIMEOUT_S = float(os.environ.get("MOONCAKE_VLLM_START_TIMEOUT", "240"))


def require_vllm() -> None:
    """Skip without vLLM, unless ``MOONCAKE_REQUIRE_VLLM`` is set (CI): then fail."""
    if VLLM_AVAILABLE:
        return
    msg = "vLLM is not installed (scripts/install-vllm installs the CPU build)"
    if os.environ.get("MOONCAKE_REQUIRE_VLLM"):
        pytest.fail(msg + "; MOONCAKE_REQUIRE_VLLM is set, so this is an error", pytrace=False)
    pytest.skip(msg)


def make_vllm_model(path: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128,
                    heads: int = 4, kv_heads: int = 2, max_position_embeddings: int = 4096) -> Path:
    """A random-weight Llama directory vLLM loads (head dim 32, which its CPU kernels take),
    with the tests' trained byte-level BPE tokenizer and chat template. Weights are float32
    on disk; servers load them as bfloat16."""
    from text_helpers import CHAT_TEMPLATE, make_tokenizer, write_llama_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_position_embeddings}))
    return write_llama_weights(path, vocab=tok.get_vocab_size(), hidden=hidden, inter=2 * hidden, layers=layers,
                               heads=heads, kv_heads=kv_heads, max_position_embeddings=max_position_embeddings,
                               seed=seed, eos=tok.token_to_id("</s>"), bos=tok.token_to_id("<s>"))


@dataclass
class VllmServer:
    """One running vLLM OpenAI server (its own process group) with ZMQ KV events."""

    model_dir: Path
    port: int
    events_port: int
    replay_port: int
    args: list[str]
    env: dict[str, str]
    log_path: Path
    block_size: int = BLOCK_SIZE
    host: str = "127.0.0.1"
    launcher: tuple[str, ...] = ()
    """A prefix of the command (e.g. ``ip netns exec NS``: it execs in place, so the
    process group is still the server's)."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    # --- life -------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Start the server and wait for ``/health``; raises with the log's tail if it dies or hangs."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process group without waiting (see :func:`start_all`)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"vLLM on port {self.port} is already running")
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([*self.launcher, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Wait for ``/health``; stops the server and raises with its log's tail if it dies or hangs."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"vLLM on port {self.port} exited with {code}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM on port {self.port} did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; its children (EngineCore, workers) may linger a moment.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> VllmServer:
        """Stop and start again on the same ports (a fresh engine: empty cache, seq from 0)."""
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- requests -----------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def complete(self, prompt: list[int] | str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
        """A greedy completion (``ignore_eos``: a random model's EOS must not end it early)."""
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **extra}
        return self.post("/v1/completions", body)

    def cached_tokens(self, prompt: list[int] | str, **extra: Any) -> int:
        """vLLM's own count of prompt tokens served from its prefix cache for ``prompt``."""
        usage = self.complete(prompt, max_tokens=1, **extra)["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


def vllm_server(model_dir: str | Path, *, block_size: int = BLOCK_SIZE, num_gpu_blocks: int | None = None,
                kv_events: bool = True, kv_transfer_config: dict[str, Any] | None = None,
                extra_args: tuple[str, ...] | list[str] = (), env: dict[str, str] | None = None,
                cpu: str | None = None, max_model_len: int = 2048, log_dir: str | Path | None = None,
                ports: tuple[int, int, int] | None = None, host: str = "127.0.0.1",
                launcher: tuple[str, ...] = ()) -> VllmServer:
    """A configured, not yet started, server (``.start()`` it). Ports are free ones unless
    given; ``cpu`` pins its OpenMP threads (e.g. ``"0"``; default: not pinned). ``host``:
    the address it listens on (and announces), ``launcher``: a command prefix such as
    ``ip netns exec NS`` to run it on another "host"."""
    port, events_port, replay_port = ports or (free_port(), free_port(), free_port())
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL_NAME, "--host", host, "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--block-size", str(block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--seed", "0"]
    if kv_events:
        args += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://{host}:{replay_port}", "topic": "kv"})]
    if num_gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    args += list(extra_args)
    full_env = dict(os.environ)
    full_env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": host,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
        # The test's own sys.path (this checkout's python/ for connectors) reaches vLLM's processes.
        "PYTHONPATH": os.pathsep.join(p for p in [package_root(), os.environ.get("PYTHONPATH", "")] if p),
    })
    if cpu is not None:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    else:
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    full_env.update(env or {})
    log_dir = Path(log_dir or os.environ.get("MOONCAKE_VLLM_LOG_DIR") or tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    return VllmServer(Path(model_dir), port, events_port, replay_port, args, full_env,
                      log_dir / f"vllm-{port}.log", block_size, host, tuple(launcher))


def package_root() -> str:
    """The directory that holds the ``mooncake_rs`` package the tests import."""
    import mooncake_rs

    return str(Path(mooncake_rs.__file__).resolve().parent.parent)


def start_vllm(model_dir: str | Path, **kw: Any) -> VllmServer:
    """:func:`vllm_server` and ``start()``."""
    timeout_s = kw.pop("timeout_s", START_TIMEOUT_S)
    return vllm_server(model_dir, **kw).start(timeout_s)


def start_all(servers: list[VllmServer], timeout_s: float = START_TIMEOUT_S) -> list[VllmServer]:
    """Start several servers at once (their ~30 s starts overlap); stops all if one fails."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@contextlib.contextmanager
def running(servers: list[VllmServer], timeout_s: float = START_TIMEOUT_S) -> Iterator[list[VllmServer]]:
    """:func:`start_all`, and every server stopped when the block ends (a fixture's
    ``with running(servers) as s: yield s``), even when a test failed."""
    start_all(servers, timeout_s)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()
