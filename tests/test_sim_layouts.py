"""KV layouts in the simulator: bytes per token come from the model's layout."""

from __future__ import annotations

import json

import pytest

from mooncake_rs import InvalidArgument, PrefillCostModel, TransferCostModel
from mooncake_rs.base.layout import BlockLayout
from mooncake_rs.sim import MLALayout, Request, SimConfig, Simulator

PM, TM = PrefillCostModel(), TransferCostModel()


def test_layout_sizes():
    # DeepSeek-V3's MLA: 61 layers x (512 latent + 64 rope) x 2 bytes
    mla = MLALayout(num_layers=61, block_size=512)
    assert mla.token_nbytes == 1152 and mla.block_nbytes == 61 * 512 * 1152
    assert mla.block_nbytes / 512 == 70_272
    # LLaMA3-70B's GQA through the engine's BlockLayout: the transfer model's default
    gqa = BlockLayout(num_layers=80, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert SimConfig(layout=gqa).models()[1].bytes_per_token == TM.bytes_per_token == 327_680


def test_layout_sets_the_bytes_of_both_the_estimate_and_the_truth():
    mla = MLALayout(num_layers=61, block_size=64)
    cfg = SimConfig(layout=mla, true_transfer_model=TransferCostModel(network_bandwidth=10e9))
    assert cfg.models()[1].bytes_per_token == 70_272
    tt = cfg.true_models()[1]
    assert tt.bytes_per_token == 70_272 and tt.network_bandwidth == 10e9
    doc = cfg.to_dict()
    json.dumps(doc)
    assert doc["layout"]["kind"] == "MLALayout" and doc["layout"]["bytes_per_token"] == 70_272
    assert "layout" not in SimConfig().to_dict()


def test_an_ssd_read_moves_the_layouts_bytes():
    a, b = Request(0.0, 8 * 512, 1, tuple(range(8))), Request(10_000.0, 8 * 512, 1, tuple(range(100, 108)))
    c = Request(100_000.0, 9 * 512 + 100, 1, tuple(list(range(8)) + [200]))
    mla = MLALayout(num_layers=61, block_size=512)
    cfg = SimConfig(
        prefill=1, decode=1, layout=mla, capacity_tokens_per_instance=8 * 512,
        ssd_capacity_tokens_per_instance=64 * 512, storage_bandwidth=1e10,
    )  # fmt: skip
    rep = Simulator(cfg).run([a, b, c])
    load = 8 * 512 * 70_272 / 1e10
    assert rep.requests[2].ttft_s == pytest.approx(load + TM.latency_s + PM.predict(c.input_length, 8 * 512), rel=1e-9)
    assert rep.bytes_loaded_per_path["ssd_direct"] == 8 * 512 * 70_272


@pytest.mark.parametrize(
    "bad",
    [object(), 3, MLALayout],
)
def test_not_a_layout_is_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        SimConfig(layout=bad)


@pytest.mark.parametrize("kw", [dict(num_layers=0), dict(latent_dim=-1), dict(rope_dim=-1), dict(dtype="int4")])
def test_bad_mla_layout(kw):
    args = dict(num_layers=61, block_size=512)
    args.update(kw)
    with pytest.raises(InvalidArgument):
        MLALayout(**args)
