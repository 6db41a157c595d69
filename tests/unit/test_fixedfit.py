"""The probe's fixed costs fitted from its timings (issue 31.6): synthetic timings.

The probe's own run (``test_probe``) shows the timings exist on a real CPU; here
known lines, with and without a busy host's outlier, must come back exactly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autohet_cli.errors import ConfigError
from autohet_cli.profiling.fixedfit import fit_line, fixed_fit, robust_line
from autohet_cli.profiling.schema import DeviceFacts, Profile, profile_from_dict, profile_to_dict


def test_a_line_is_recovered_exactly() -> None:
    points = [(1.0, 2.3), (2.0, 2.6), (4.0, 3.2)]
    assert robust_line(points) == pytest.approx((2.0, 0.3))
    assert fit_line(points) == pytest.approx((2.0, 0.3))


def test_one_inflated_time_does_not_tilt_the_robust_line() -> None:
    """A busy spell of the host tripled one median: least squares moves, Theil-Sen not."""
    points = [(1.0, 2.3), (2.0, 7.8), (4.0, 3.2), (8.0, 4.4)]
    intercept, slope = robust_line(points) or (0.0, 0.0)
    assert intercept == pytest.approx(2.0) and slope == pytest.approx(0.3)
    assert fit_line(points) != pytest.approx((2.0, 0.3), rel=0.1)


def test_too_few_or_flat_timings_measure_nothing() -> None:
    assert robust_line([(1.0, 2.0)]) is None and fit_line([(1.0, 2.0), (1.0, 3.0)]) is None
    falling = {"1": 3.0, "2": 2.0, "4": 1.0}  # noise, not a cost per layer
    assert fixed_fit(falling, [], 100).step_ms is None
    assert fixed_fit(None, [(1.0, 5.0)], 100).op_us is None
    assert robust_line([(0.0, -1.0), (1.0, 0.0)]) == (0.0, 1.0)  # clamped at 0


def test_the_op_time_is_the_blocks_intercept_over_its_ops() -> None:
    # forward + backward of a block at micro-batches 1, 2 and 8: 1.5 ms at zero samples
    block = [(1.0, 1.8), (2.0, 2.1), (8.0, 3.9)]
    fitted = fixed_fit({"1": 2.3, "2": 2.6, "4": 3.2}, block, 150)
    assert fitted.op_us == pytest.approx(1.5 / 150 * 1e3)  # 10 us
    assert fitted.step_ms == pytest.approx(2.0)
    assert "10.0 us per op, 2.00 ms per training iteration" in fitted.note()
    # malformed pairs are skipped, the rest still fit
    assert fixed_fit({"1": 2.3, "x": 1, "2": "nan", "4": 3.2}, [], 1).step_ms == pytest.approx(2.0)


def test_the_fitted_costs_round_trip_and_are_checked() -> None:
    facts = DeviceFacts(
        gpu_type="cpu",
        mem_bytes=1 << 30,
        matmul_tflops=0.05,
        mem_bandwidth_gbytes_s=10.0,
        source="measured",
        op_us=12.5,
        step_ms=0.75,
    )
    raw = profile_to_dict(Profile(devices={"cpu": facts}))
    assert profile_from_dict(raw, "p.yaml").devices["cpu"] == facts
    raw["devices"]["cpu"]["op_us"] = -1.0
    with pytest.raises(ConfigError, match=r"p.yaml: devices.cpu.op_us: must be >= 0"):
        profile_from_dict(raw, "p.yaml")
    older = Profile(devices={"cpu": facts})
    newer = Profile(devices={"cpu": replace(facts, op_us=None, step_ms=None)})
    assert older.merged_with(newer).devices["cpu"].op_us == 12.5  # a probe before 1.2
