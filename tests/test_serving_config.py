"""``ServingConfig`` (serving/config.py): one frozen configuration, checked once, built
the same way from ``serve --model`` and ``serve --etcd`` and from ``Cluster``'s keywords."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_rs.cli import build_parser
from mooncake_rs.errors import InvalidArgument
from mooncake_rs.serving.config import HEARTBEAT_ACROSS_HOSTS_S, ServingConfig


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_it_is_frozen_all_the_way_down() -> None:
    kw = {"dtype": "float32"}
    cfg = ServingConfig(engine_kwargs=kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "random"  # type: ignore[misc]
    kw["dtype"] = "bfloat16"  # the caller's dict changes: the configuration does not
    assert cfg.engine_kwargs["dtype"] == "float32"
    with pytest.raises(TypeError):
        cfg.engine_kwargs["device"] = "cpu"  # type: ignore[index]


@pytest.mark.parametrize("kw, says", [
    (dict(prefill=0), "prefill >= 1"),
    (dict(decode=True), "decode >= 1"),
    (dict(block_size=0), "block_size"),
    (dict(policy="fastest"), "policy"),
    (dict(rejection="sometimes"), "rejection"),
    (dict(ttft_slo_s=0), "ttft_slo_s"),
    (dict(tbt_slo_s=float("inf")), "tbt_slo_s"),
    (dict(heartbeat_timeout_s=-1.0), "heartbeat_timeout_s"),
    (dict(link_bandwidth=0), "link_bandwidth"),
    (dict(ssd_bytes_per_instance=-1), "ssd_bytes_per_instance"),
    (dict(engine_kwargs=["dtype"]), "engine_kwargs"),
])
def test_bad_values_are_typed_errors_naming_the_field(kw, says) -> None:
    with pytest.raises(InvalidArgument, match=says):
        ServingConfig(**kw)


def test_the_two_command_lines_map_the_same_flags_to_the_same_fields() -> None:
    flags = ["--policy", "random", "--ttft-slo", "2.5", "--tbt-slo", "0.5", "--rejection", "early",
             "--no-prefix-reuse", "--multipath", "--seed", "7", "--heartbeat-timeout", "3",
             "--replicate-every", "2", "--replica-max-bytes", "1e9"]
    embedded = ServingConfig.from_args(_args("--model", "tiny", *flags))
    across = ServingConfig.from_args(_args("--etcd", "http://127.0.0.1:2379", "--listen", "127.0.0.1:9000", *flags))
    assert embedded == across
    assert (embedded.policy, embedded.ttft_slo_s, embedded.tbt_slo_s, embedded.rejection, embedded.prefix_reuse,
            embedded.multipath, embedded.seed, embedded.heartbeat_timeout_s) == (
        "random", 2.5, 0.5, "early", False, True, 7, 3.0)
    assert (embedded.replicate_every_s, embedded.replica_max_bytes) == (2.0, 1e9)


def test_defaults_follow_the_mode() -> None:
    embedded = ServingConfig.from_args(_args("--model", "tiny"))
    assert embedded == ServingConfig()  # the same defaults as Cluster's keywords
    across = ServingConfig.from_args(_args("--etcd", "http://127.0.0.1:2379", "--listen", "127.0.0.1:9000"))
    assert across.heartbeat_timeout_s == HEARTBEAT_ACROSS_HOSTS_S
    assert dataclasses.replace(across, heartbeat_timeout_s=embedded.heartbeat_timeout_s) == embedded


def test_instance_flags() -> None:
    cfg = ServingConfig.from_args(_args("--model", "tiny", "--prefill", "3", "--decode", "2", "--block-size", "8",
                                        "--dram-bytes", "1048576", "--processes", "--dtype", "bfloat16",
                                        "--ssd-path", "/tmp/x"))
    assert (cfg.prefill, cfg.decode, cfg.block_size, cfg.dram_bytes_per_instance, cfg.processes) == (
        3, 2, 8, 1 << 20, True)
    assert dict(cfg.engine_kwargs) == {"dtype": "bfloat16"}
    assert cfg.ssd_bytes == 4 << 20  # 4x the DRAM unless told
    with pytest.raises(InvalidArgument, match="prefill"):
        ServingConfig.from_args(_args("--model", "tiny", "--prefill", "0"))
    with pytest.raises(InvalidArgument, match="replicate_every_s"):
        ServingConfig.from_args(_args("--model", "tiny", "--replicate-every", "0"))


def test_the_prefetch_room_is_the_instances_store_not_the_cores_default() -> None:
    """A prefix fetched at acceptance lands in the instance's store: the conductor's
    prefetch room is that store's DRAM (the core's default, 64 GB, would price prefetches
    an instance cannot hold); a deployment passes its workers' size."""
    from mooncake_rs._core import ConductorConfig

    cfg = ServingConfig(dram_bytes_per_instance=32 << 20)
    assert ConductorConfig().prefetch_staging_bytes > 32 << 20
    assert cfg.conductor_args(16)["prefetch_staging_bytes"] == float(32 << 20)
    assert cfg.conductor_args(16, dram_bytes=1 << 30)["prefetch_staging_bytes"] == float(1 << 30)
    assert ConductorConfig(**cfg.conductor_args(16)).prefetch_staging_bytes == float(32 << 20)

