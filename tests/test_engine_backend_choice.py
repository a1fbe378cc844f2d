"""Backend and default-dtype choice (pure functions; no CUDA needed).

Every case of ``choose_backend``: which backend for which device, dtype, head dim, page
size and flashinfer availability, and the messages of the refusals; then ``resolve_dtype``
and the engine on CPU wiring them in.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from mooncake_rs.engine.backend_choice import (FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS, FLASHINFER_PAGE_SIZES,
                                               choose_backend, default_dtype, flashinfer_unsupported,
                                               resolve_dtype)
from mooncake_rs.errors import InvalidArgument

GOOD = dict(device_type="cuda", dtype_name="bfloat16", head_dim=128, page_size=16, flashinfer_available=True)


def choose(requested, **changes):
    kw = {**GOOD, **changes}
    return choose_backend(requested, kw["device_type"], kw["dtype_name"], kw["head_dim"], kw["page_size"],
                          kw["flashinfer_available"])


@pytest.mark.parametrize("dtype,head_dim,page_size", list(itertools.product(
    ("float32", "bfloat16", "float16"), (16, 32, 64, 96, 128, 256, 512), (1, 3, 8, 16, 24, 128, 256))))
@pytest.mark.parametrize("device", ("cuda", "cpu"))
@pytest.mark.parametrize("available", (True, False))
def test_auto_picks_flashinfer_exactly_when_everything_is_supported(dtype, head_dim, page_size, device, available):
    name, reason = choose("auto", device_type=device, dtype_name=dtype, head_dim=head_dim, page_size=page_size,
                          flashinfer_available=available)
    ok = (device == "cuda" and available and dtype in ("bfloat16", "float16") and head_dim in (64, 128, 256)
          and page_size in (1, 2, 4, 8, 16, 32, 64, 128))
    assert name == ("flashinfer" if ok else "torch")
    assert reason.startswith("auto chose " + name)
    # torch is always granted; flashinfer exactly when auto would pick it
    assert choose("torch", device_type=device, dtype_name=dtype, head_dim=head_dim, page_size=page_size,
                  flashinfer_available=available)[0] == "torch"
    if ok:
        assert choose("flashinfer", device_type=device, dtype_name=dtype, head_dim=head_dim,
                      page_size=page_size, flashinfer_available=available)[0] == "flashinfer"
    else:
        with pytest.raises(InvalidArgument, match="attention_backend='flashinfer' cannot run"):
            choose("flashinfer", device_type=device, dtype_name=dtype, head_dim=head_dim, page_size=page_size,
                   flashinfer_available=available)


def test_supported_sets():
    assert FLASHINFER_DTYPES == ("bfloat16", "float16")
    assert FLASHINFER_HEAD_DIMS == (64, 128, 256)
    assert 16 in FLASHINFER_PAGE_SIZES and all(p & (p - 1) == 0 for p in FLASHINFER_PAGE_SIZES)


def test_cuda_bf16_head128_is_flashinfer():
    assert choose("auto") == ("flashinfer", "auto chose flashinfer: CUDA, bfloat16, head_dim 128, page_size 16")


@pytest.mark.parametrize("changes,fragment", [
    (dict(dtype_name="float32"), "dtype float32 has no FlashInfer kernels (supported: bfloat16, float16)"),
    (dict(head_dim=16), "head_dim 16 has no FlashInfer kernels (supported: 64, 128, 256)"),
    (dict(page_size=24), "page_size 24 is not supported with FlashInfer (supported: 1, 2, 4, 8, 16, 32, 64, 128)"),
    (dict(device_type="cpu"), "device 'cpu' is not CUDA"),
    (dict(flashinfer_available=False), "the flashinfer package does not import"),
])
def test_reasons_name_what_is_unsupported_and_what_is(changes, fragment):
    name, reason = choose("auto", **changes)
    assert name == "torch" and fragment in reason
    with pytest.raises(InvalidArgument) as e:
        choose("flashinfer", **changes)
    assert fragment in str(e.value) and "attention_backend='torch'" in str(e.value)


def test_every_reason_is_listed():
    why = flashinfer_unsupported("cuda", "float32", 16, 24, True)
    assert len(why) == 3 and "float32" in why[0] and "head_dim 16" in why[1] and "page_size 24" in why[2]
    # off CUDA the package is not the question; the device is
    why = flashinfer_unsupported("cpu", "bfloat16", 64, 16, False)
    assert why == ["device 'cpu' is not CUDA (FlashInfer runs on CUDA only)"]
    assert flashinfer_unsupported(**GOOD) == []


@pytest.mark.parametrize("bad", ["Torch", "flash", "", None, 3])
def test_unknown_backend_name(bad):
    with pytest.raises(InvalidArgument, match="attention_backend must be one of"):
        choose(bad)


def test_default_dtype():
    assert default_dtype("cuda") == "bfloat16"
    assert default_dtype("cpu") == "float32"
    assert default_dtype("mps") == "float32"
    assert resolve_dtype(None, "cuda") == "bfloat16"
    assert resolve_dtype(None, "cpu") == "float32"
    for d in ("float32", "bfloat16", "float16"):  # an explicit dtype wins on every device
        assert resolve_dtype(d, "cuda") == d and resolve_dtype(d, "cpu") == d
    with pytest.raises(InvalidArgument, match="dtype must be one of"):
        resolve_dtype("fp8", "cuda")
    # the CUDA defaults together are a FlashInfer configuration for a head dim it has
    assert choose("auto", dtype_name=resolve_dtype(None, "cuda"), head_dim=64)[0] == "flashinfer"


def test_engine_on_cpu_uses_the_choice(caplog):
    pytest.importorskip("torch")
    from mooncake_rs.engine import Engine, ModelConfig

    e = Engine(ModelConfig.tiny(), num_pages=8)
    assert e.dtype == "float32" and e.attention_backend == "torch"
    assert Engine(ModelConfig.tiny(), dtype="bfloat16", num_pages=8).dtype == "bfloat16"
    with caplog.at_level(logging.DEBUG, logger="mooncake_rs.engine"):
        Engine(ModelConfig.tiny(), num_pages=8, attention_backend="auto")
    assert any("auto chose torch: device 'cpu' is not CUDA" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidArgument, match="device 'cpu' is not CUDA.*dtype float32.*head_dim 16"):
        Engine(ModelConfig.tiny(), num_pages=8, attention_backend="flashinfer")
    with pytest.raises(InvalidArgument, match="dtype must be one of"):
        Engine(ModelConfig.tiny(), num_pages=8, dtype="fp8")


def test_tiny_gpu_preset_is_a_flashinfer_shape():
    from mooncake_rs.engine import ModelConfig

    cfg = ModelConfig.preset("tiny-gpu")
    assert cfg.head_dim == 64 and cfg.num_layers == 2 and cfg.dtype == "bfloat16"
    assert choose("auto", dtype_name=resolve_dtype(None, "cuda"), head_dim=cfg.head_dim)[0] == "flashinfer"
    # the tiny preset (head_dim 16) is not: the GPU tests must not use it with FlashInfer
    assert choose("auto", head_dim=ModelConfig.tiny().head_dim)[0] == "torch"


def test_tiny_gpu_preset_runs_on_cpu():
    pytest.importorskip("torch")
    from mooncake_rs.engine import Engine, SamplingParams

    e = Engine("tiny-gpu", num_pages=32)
    assert e.dtype == "float32" and e.config.head_dim == 64
    out = e.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]
    assert all(0 <= t < 512 for o in out for t in o.token_ids)
