"""Learning an engine's KV block size and its LoRA adapters (a stand-in HTTP server on
127.0.0.1 answering as vLLM 0.32 does; the real one is in test_vllm_interop.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mooncake_rs import InvalidArgument
from mooncake_rs.interop.engine_info import block_size_from_metrics, discover_block_size, lora_adapters
from mooncake_rs.interop.upstream import UpstreamRouter, UpstreamSpec

METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="%d",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""
MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "root": "/m", "parent": None},
                                     {"id": "sql-lora", "object": "model", "root": "/l", "parent": "tiny"}]}


class _Engine:
    def __init__(self, block_size: int | None):
        size = block_size

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                if self.path == "/metrics" and size is not None:
                    body, kind = (METRICS % size).encode(), "text/plain"
                elif self.path == "/v1/models":
                    body, kind = json.dumps(MODELS).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines():
    made: list[_Engine] = []
    yield lambda size: made.append(_Engine(size)) or made[-1]
    for e in made:
        e.close()


def test_block_size_from_vllm_metrics(engines):
    e = engines(128)
    assert block_size_from_metrics(e.url) == 128
    assert discover_block_size(e.url) == 128
    assert block_size_from_metrics(engines(None).url) is None  # no such gauge
    assert lora_adapters(e.url) == {"sql-lora"}


def test_router_takes_the_engines_block_size(engines):
    a, b = engines(32), engines(32)
    r = UpstreamRouter([UpstreamSpec("a", a.url), UpstreamSpec("b", b.url)], subscribe=False)
    assert r.block_size == 32 and r.hasher.block_size == 32


def test_router_refuses_engines_of_different_or_unknown_block_sizes(engines):
    a, b = engines(32), engines(128)
    with pytest.raises(InvalidArgument, match="different sizes"):
        UpstreamRouter([UpstreamSpec("a", a.url), UpstreamSpec("b", b.url)], subscribe=False)
    with pytest.raises(InvalidArgument, match="pass --block-size"):
        UpstreamRouter([UpstreamSpec("c", engines(None).url)], subscribe=False)


def test_register_without_block_size_learns_it_from_the_replay_buffer():
    pytest.importorskip("zmq")
    from interop_helpers import FakePublisher

    from mooncake_rs.kv_events import BlockStored, encode_batch
    from mooncake_rs.interop.indexer import Indexer
    from mooncake_rs.interop.indexer_api import RegisterRequest

    pub = FakePublisher(replay=True)
    try:
        pub.publish(0, encode_batch([BlockStored([1], None, list(range(64)), 64, None, "GPU")]), send=False)
        ix = Indexer(subscribe=False)
        ix.register(RegisterRequest(endpoint=pub.endpoint, type="vLLM", modelname="m", instance_id="i",
                                    replay_endpoint=pub.replay_endpoint))
        assert [g[2] for g in ix._groups] == [64]
        with pytest.raises(InvalidArgument, match="block_size is missing"):
            ix.register(RegisterRequest(endpoint=pub.endpoint, type="vLLM", modelname="m", instance_id="j"))
        ix.close()
    finally:
        pub.close()
