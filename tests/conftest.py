import os

# Tests never depend on the machine's logging configuration.
os.environ.setdefault("MOONCAKE_LOG", "warn")


# --- real vLLM servers (tests marked `vllm`; see tests/vllm_support.py) -------------------
# One model and one pair of servers for the whole run: each start costs ~30 s and ~3 GB.

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    from vllm_support import make_vllm_model, require_vllm

    require_vllm()
    return make_vllm_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def vllm_pair(vllm_model_dir, tmp_path_factory):
    """Two real vLLM servers (prefix caching, KV events with replay, one core each), the
    same model; the second with a 64-block cache (evictions). Stopped at the end of the
    run even when tests fail. Tests that change a server's state in a way others would
    see (a restart, a cache reset) restore it; each test uses prompts of its own."""
    from vllm_support import running, vllm_server

    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [vllm_server(vllm_model_dir, cpu=str(i % max(1, os.cpu_count() or 1)), log_dir=logs,
                           num_gpu_blocks=None if i == 0 else 64, max_model_len=2048 if i == 0 else 1024)
               for i in range(2)]
    with running(servers):
        yield servers
