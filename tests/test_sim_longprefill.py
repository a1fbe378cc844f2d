"""Long-prompt cost models: chunked pipeline parallelism vs sequence parallelism."""

from __future__ import annotations

import pytest

from mooncake_rs import InvalidArgument, PrefillCostModel
from mooncake_rs.sim.longprefill import LongPrefillModel, cpp_stage_times, cpp_time, sp_time

PM = PrefillCostModel()
M = LongPrefillModel()


def test_one_instance_is_the_plain_prefill():
    for n in (1000, 16384, 131072):
        assert cpp_time(M, n, 1, n) == pytest.approx(PM.predict(n, 0), rel=1e-12)
        assert sp_time(M, n, 1) == pytest.approx(PM.predict(n, 0), rel=1e-12)
        # chunked on one instance: every chunk is a prefill over the chunks before it
        want = sum(PM.predict(min(p + 4096, n), p) for p in range(0, n, 4096))
        assert cpp_time(M, n, 1, 4096) == pytest.approx(want, rel=1e-12)


def test_equal_chunks_follow_the_closed_form():
    n, N, C = 65536, 4, 4096
    s = cpp_stage_times(M, n, N, C)
    hop = C * M.act_bytes_per_token / M.nic_bandwidth + M.latency_s
    assert cpp_time(M, n, N, C) == pytest.approx(sum(s) + (N - 1) * (s[-1] + hop), rel=1e-12)


def test_more_instances_cut_a_long_prompt_and_sp_turns_network_bound():
    n = 131072
    cpp = [cpp_time(M, n, N, 8192) for N in (1, 2, 4, 8)]
    sp = [sp_time(M, n, N) for N in (1, 2, 4, 8)]
    assert cpp == sorted(cpp, reverse=True) and sp == sorted(sp, reverse=True)
    # on a slow network SP is bound by its ring traffic; CPP only sends activations
    slow = LongPrefillModel(nic_bandwidth=1e9)
    traffic = 7 / 8 * n * slow.bytes_per_token / 1e9
    assert sp_time(slow, n, 8) == pytest.approx(traffic + 80 * 7 * slow.latency_s, rel=1e-9)
    assert cpp_time(slow, n, 8, 8192) < sp_time(slow, n, 8)


@pytest.mark.parametrize(
    "call",
    [
        lambda: cpp_time(M, 0, 2, 512),
        lambda: cpp_time(M, 100, 0, 512),
        lambda: cpp_time(M, 100, 2, 0),
        lambda: sp_time(M, 100, True),
        lambda: LongPrefillModel(num_layers=0),
        lambda: LongPrefillModel(nic_bandwidth=-1.0),
        lambda: LongPrefillModel(latency_s=float("nan")),
    ],
)
def test_bad_input_is_invalid_argument(call):
    with pytest.raises(InvalidArgument):
        call()
