"""The client side needs no torch: the client types (``SamplingParams``, ``RequestOutput``,
``BlockLayout``, ``ModelConfig``), the package, the serving and sim packages import
without it, and a ``Cluster(..., processes=True)`` generates without importing it in the
caller's process (its workers do). Each check runs in a fresh interpreter in which any
attempt to import torch is recorded with its traceback, so a failure says who tried."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mooncake_rs import InvalidArgument
from mooncake_rs.base.model_config import ModelConfig
from mooncake_rs.base.layout import DTYPE_SIZES, BlockLayout, LayerSpan
from mooncake_rs.base.outputs import RequestOutput
from mooncake_rs.base.params import SamplingParams

# Prepended to every child: records (and refuses) any import of torch, with the stack.
_GUARD = textwrap.dedent("""
    import sys, traceback
    _attempts = []
    class _NoTorch:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                _attempts.append("".join(traceback.format_stack(limit=25)))
                raise ImportError("torch imported in a client process (see the test's report)")
            return None
    sys.meta_path.insert(0, _NoTorch)
    def _check():
        assert not _attempts, "torch was imported from:\\n" + _attempts[0]
        assert "torch" not in sys.modules
""")


def _run_child(body: str, timeout: float = 120) -> str:
    code = _GUARD + textwrap.dedent(body) + "\n_check()\n"
    env = dict(os.environ, MOONCAKE_LOG="warn")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"child failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_client_modules_import_without_torch():
    _run_child("""
        import mooncake_rs
        import mooncake_rs.engine
        import mooncake_rs.serving
        import mooncake_rs.sim
        from mooncake_rs import SamplingParams, RequestOutput, BlockLayout, ModelConfig, Cluster
        from mooncake_rs.engine import (SamplingParams as S2, RequestOutput as R2, BlockLayout as B2, LayerSpan,
                                        ModelConfig as M2, PRESETS, TokenEvent, LayerEvent, PrefillTiming)
        from mooncake_rs.base.params import SamplingParams as S3
        from mooncake_rs.base.outputs import RequestOutput as R3
        from mooncake_rs.base.layout import BlockLayout as B3
        from mooncake_rs.engine.tokens import prompt_tokens
        assert SamplingParams is S2 is S3 and RequestOutput is R2 is R3 and BlockLayout is B2 is B3
        assert ModelConfig is M2
        # and they work: validation with typed errors, block sizes
        try:
            SamplingParams(top_p=0.0)
        except mooncake_rs.InvalidArgument:
            pass
        else:
            raise AssertionError("top_p=0 accepted")
        assert BlockLayout.for_model(ModelConfig.tiny(), 16, "bfloat16").block_nbytes == 2 * 2 * 16 * 2 * 16 * 2
        assert prompt_tokens([1, 2], SamplingParams()) == [1, 2]
        out = RequestOutput("r", [1], [2], "stop")
        assert out.finished
    """)


def test_the_guard_catches_torch():
    """The child's guard itself: importing the engine's model must be reported."""
    pytest.importorskip("torch")
    with pytest.raises(AssertionError, match="torch"):
        _run_child("import mooncake_rs.engine.sampler")
    with pytest.raises(AssertionError, match="torch"):
        _run_child("from mooncake_rs.engine import Engine")


def test_cluster_with_processes_generates_without_torch_in_the_caller():
    pytest.importorskip("torch")  # the workers run the engine
    from serving_helpers import BLOCK, reference_outputs, shared_prefix_prompts

    prompts = shared_prefix_prompts(3, seed=7) + [[9]]
    out = _run_child(f"""
        import json
        import mooncake_rs
        from mooncake_rs import Cluster, SamplingParams, ModelConfig
        prompts = {prompts!r}
        params = SamplingParams(max_tokens=6)
        with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size={BLOCK}, dram_bytes_per_instance=4 << 20,
                     seed=3, processes=True) as c:
            outs = c.generate(prompts, params, timeout_s=120)
            streamed = list(c.submit(prompts[0], params, timeout_s=60))
            try:
                c.submit([1, 2], "not params")
            except mooncake_rs.InvalidArgument:
                pass
            else:
                raise AssertionError("bad params accepted")
        print(json.dumps({{"tokens": [o.token_ids for o in outs], "streamed": streamed,
                          "reasons": [o.finish_reason for o in outs]}}))
    """, timeout=240)
    got = json.loads(out.strip().splitlines()[-1])
    ref = reference_outputs(prompts, SamplingParams(max_tokens=6), seed=3)
    assert got["tokens"] == ref
    assert got["streamed"] == ref[0]
    assert got["reasons"] == ["length"] * len(prompts)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=-1), "seed"),
    (dict(seed="3"), "seed"),
])
def test_sampling_params_refuse_bad_values_with_invalid_argument(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop_tokens():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4) and p.greedy and not SamplingParams(temperature=0.5).greedy


def test_block_layout_without_torch_matches_the_formula():
    cfg = ModelConfig.tiny()
    for dtype, size in DTYPE_SIZES.items():
        lay = BlockLayout.for_model(cfg, 16, dtype)
        assert lay.dtype_size == size
        assert lay.layer_nbytes == 2 * 16 * cfg.num_kv_heads * cfg.head_dim * size
        assert lay.block_nbytes == cfg.num_layers * lay.layer_nbytes
        assert lay.spans() == [LayerSpan(l, l * lay.layer_nbytes, lay.layer_nbytes) for l in range(cfg.num_layers)]
    for bad in ("int8", "fp32", None):
        with pytest.raises(InvalidArgument, match="dtype"):
            BlockLayout(2, 16, 2, 8, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="block_size"):
        BlockLayout(2, 0, 2, 8, "float32")
    with pytest.raises(InvalidArgument, match="layer"):
        BlockLayout(2, 16, 2, 8, "float32").layer_span(2)


def test_torch_free_types_agree_with_the_engine():
    """The dtype table equals torch's element sizes; the engine package's API names the
    bottom layer's very objects (so isinstance checks across imports keep working), and
    the engine's modules no longer re-export them from their old homes."""
    torch = pytest.importorskip("torch")
    import mooncake_rs.engine as engine_pkg
    from mooncake_rs.engine import kv_cache, sampler, weights

    for name, size in DTYPE_SIZES.items():
        assert torch.empty((), dtype=weights.torch_dtype(name)).element_size() == size
    from mooncake_rs.base.model_config import DTYPES

    assert set(DTYPE_SIZES) == set(DTYPES)
    assert engine_pkg.SamplingParams is SamplingParams and engine_pkg.BlockLayout is BlockLayout
    assert engine_pkg.LayerSpan is LayerSpan and engine_pkg.RequestOutput is RequestOutput
    assert "SamplingParams" not in sampler.__all__ and "BlockLayout" not in kv_cache.__all__
    from mooncake_rs.engine import engine, tokens

    assert engine.prompt_tokens is tokens.prompt_tokens  # the engine uses the one helper
    import mooncake_rs

    assert mooncake_rs.SamplingParams is SamplingParams and mooncake_rs.RequestOutput is RequestOutput
    assert mooncake_rs.BlockLayout is BlockLayout and mooncake_rs.ModelConfig is ModelConfig
    assert mooncake_rs.engine.Engine is engine.Engine and mooncake_rs.engine.KVCache is kv_cache.KVCache


def test_engine_and_kv_cache_load_on_first_access():
    """``import mooncake_rs.engine`` loads no torch; ``Engine`` and ``KVCache`` load their
    modules (and torch) on first access. The submodules themselves are imported by name
    (``import mooncake_rs.engine.sampler``), not reached as attributes."""
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import sys
        import mooncake_rs.engine as e
        assert "torch" not in sys.modules
        import mooncake_rs.engine.kv_cache as kv_cache
        assert kv_cache.KVCache is e.KVCache and "torch" in sys.modules
        import mooncake_rs.engine.engine as engine_mod
        assert e.Engine is engine_mod.Engine
        assert {"Engine", "KVCache", "SamplingParams"} <= set(dir(e))
        try:
            e.no_such_name
        except AttributeError as err:
            assert "no_such_name" in str(err)
        else:
            raise AssertionError("unknown attribute resolved")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
