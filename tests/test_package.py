import subprocess
import sys

import pytest

import mooncake_rs
from mooncake_rs import errors


def test_import_does_not_import_torch():
    code = "import sys, mooncake_rs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exception_tree():
    for name in errors.__all__:
        cls = getattr(mooncake_rs, name)
        assert issubclass(cls, mooncake_rs.MooncakeError) or cls is mooncake_rs.MooncakeError
    assert issubclass(mooncake_rs.InvalidArgument, ValueError)
    assert issubclass(mooncake_rs.TransferTimeout, TimeoutError)
    e = mooncake_rs.Overloaded("ttft", reason="ttft", estimates={"est_ttft_s": 2.0})
    assert e.reason == "ttft" and e.estimates == {"est_ttft_s": 2.0}


def test_rust_errors_arrive_as_the_tree():
    with pytest.raises(mooncake_rs.InvalidArgument, match="block_size"):
        mooncake_rs.PrefixHasher(0)
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
        mooncake_rs.BlockIndex().insert(0, [1], tier="nvme")


def test_version_matches_package_metadata():
    from importlib.metadata import version

    assert mooncake_rs.__version__ == version("mooncake-rs")


def test_log_level_from_env():
    from mooncake_rs._logging import level_from_env
    import logging

    assert level_from_env("debug") == logging.DEBUG
    assert level_from_env("mooncake_core=trace,info") == logging.INFO
    assert level_from_env("nonsense") == logging.WARNING
