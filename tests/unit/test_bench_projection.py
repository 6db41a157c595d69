"""The recovery benchmark's pure parts: the projection to real sizes, the targets,
stage cuts, copy rates from recover's report and the settings it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autohet_cli.hfconfig import load_hf_config
from benchmarks._recovery import (
    HF_CONFIG_200M,
    balanced_cuts,
    copy_paths,
    copy_rate,
    remote_bytes_per_s,
    repeats,
)
from benchmarks.recovery_projection import (
    GBIT,
    MeasuredWay,
    RealParts,
    RealSize,
    issue_targets,
    project,
    project_with,
    speedup,
)


def test_projection_scales_bytes_and_load_and_keeps_fixed_parts() -> None:
    # Measured on 1 GB: peers sent half of it, remote a quarter; load 2 s.
    way = MeasuredWay(fixed_s=10.0, load_s=2.0, bytes_from_peers=0.5e9, bytes_from_remote=0.25e9)
    real = RealSize(checkpoint_bytes=15e9, peer_bytes_per_s=3e9, remote_bytes_per_s=0.3e9)
    p = project(way, measured_bytes=1e9, real=real)
    assert p.peer_bytes == pytest.approx(7.5e9)
    assert p.remote_bytes == pytest.approx(3.75e9)
    assert p.transfer_s == pytest.approx(7.5e9 / 3e9 + 3.75e9 / 0.3e9)  # 2.5 + 12.5
    assert p.load_s == pytest.approx(30.0)  # 2 s per GB, 15 GB
    assert p.total_s == pytest.approx(10.0 + 15.0 + 30.0)


def test_projection_at_a_stated_disk_rate() -> None:
    way = MeasuredWay(fixed_s=1.0, load_s=99.0, bytes_from_peers=0.0, bytes_from_remote=0.0)
    real = RealSize(checkpoint_bytes=15e9, load_bytes_per_s=3e9)
    p = project(way, measured_bytes=2e9, real=real)
    assert p.load_s == pytest.approx(5.0)
    assert p.transfer_s == 0.0
    assert p.total_s == pytest.approx(6.0)


def test_defaults_are_the_issues_real_sizes_and_the_speedup_is_the_ratio() -> None:
    real = RealSize()
    assert real.checkpoint_bytes == 15e9
    assert real.peer_bytes_per_s == pytest.approx(25e9 / 8)
    assert real.remote_bytes_per_s == pytest.approx(2.5e9 / 8)
    ours = project(
        MeasuredWay(fixed_s=5.0, load_s=0.0, bytes_from_peers=1e9, bytes_from_remote=0.0),
        measured_bytes=1e9,
        real=real,
    )
    base = project(
        MeasuredWay(fixed_s=5.0, load_s=0.0, bytes_from_peers=0.0, bytes_from_remote=1e9),
        measured_bytes=1e9,
        real=real,
    )
    assert ours.total_s == pytest.approx(5.0 + 15e9 / (25 * GBIT))  # 9.8 s
    assert base.total_s == pytest.approx(5.0 + 15e9 / (2.5 * GBIT))  # 53 s
    assert speedup(ours, base) == pytest.approx(base.total_s / ours.total_s)


@pytest.mark.parametrize(
    ("kwargs", "measured"),
    [
        ({"fixed_s": -1.0}, 1e9),
        ({"bytes_from_remote": -5.0}, 1e9),
        ({}, 0.0),
    ],
)
def test_projection_refuses_nonsense(kwargs: dict[str, float], measured: float) -> None:
    base = {"fixed_s": 1.0, "load_s": 1.0, "bytes_from_peers": 1.0, "bytes_from_remote": 1.0}
    with pytest.raises(ValueError):
        project(MeasuredWay(**(base | kwargs)), measured_bytes=measured, real=RealSize())
    with pytest.raises(ValueError, match="peer_bytes_per_s"):
        RealSize(peer_bytes_per_s=0)


def test_targets_pass_miss_and_unmeasured() -> None:
    met = issue_targets(
        bytes_from_remote=0, peer_bytes_per_s=1.2e9, total_200m_s=14.0, projected_speedup=6.0
    )
    assert [t.verdict for t in met] == ["PASS"] * 4
    missed = issue_targets(
        bytes_from_remote=1, peer_bytes_per_s=0.9e9, total_200m_s=15.5, projected_speedup=4.9
    )
    assert [t.verdict for t in missed] == ["MISS"] * 4
    unknown = issue_targets(
        bytes_from_remote=0, peer_bytes_per_s=None, total_200m_s=None, projected_speedup=None
    )
    assert [t.verdict for t in unknown] == ["PASS", "n/a", "n/a"]  # no 200m: no time bound
    assert "200m kill to first step" not in [t.name for t in unknown]
    assert met[1].line() == "peer rate (one pair of hosts alone): 1.20 >= 1 GB/s: PASS"


def test_balanced_cuts_minimise_the_heaviest_stage() -> None:
    assert balanced_cuts([1, 1, 1, 1, 1, 1], 3) == ((0, 2), (2, 4), (4, 6))
    assert balanced_cuts([5, 1, 1, 1, 1, 5], 3) == ((0, 1), (1, 5), (5, 6))
    assert balanced_cuts([3], 1) == ((0, 1),)
    cuts = balanced_cuts([9, 1, 1, 1], 4)
    assert cuts == ((0, 1), (1, 2), (2, 3), (3, 4))  # never an empty stage
    with pytest.raises(ValueError):
        balanced_cuts([1, 1], 3)


def test_the_200m_llama_splits_with_a_share_of_blocks_on_every_host(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG_200M))
    spec = load_hf_config(str(tmp_path / "config.json"))
    weights = [x.num_params for x in spec.layers()]
    cuts = balanced_cuts(weights, 3)
    assert cuts[0][0] == 0 and cuts[-1][1] == spec.num_layers
    assert all(b - a >= 2 for a, b in cuts)  # every stage holds blocks, not only ends
    shares = [sum(weights[a:b]) for a, b in cuts]
    assert max(shares) / min(shares) < 1.1
    assert 190e6 < spec.num_params < 210e6


def test_copy_rate_from_per_file_transfers() -> None:
    report = {
        "bytes_from_peers": 300,
        "bytes_from_remote": 100,
        "phases": {"transfer": 10.0},
        "transfers": [
            {"file": "a", "source_kind": "peer", "bytes": 200, "seconds": 1.0},
            {"file": "b", "source_kind": "local", "bytes": 100, "seconds": 1.0},
            {"file": "c", "source_kind": "remote", "bytes": 100, "seconds": 4.0},
        ],
    }
    assert copy_rate(report, remote=False) == (150.0, "per file, from recover")
    assert copy_rate(report, remote=True)[0] == 25.0
    assert copy_rate({**report, "transfers": []}, remote=False)[0] is None


def test_copy_paths_are_counted_by_source_and_path() -> None:
    transfers = [
        {"source_kind": "peer", "path": "direct"},
        {"source_kind": "peer", "path": "direct"},
        {"source_kind": "remote", "path": "relayed"},
    ]
    assert copy_paths({"transfers": transfers}) == "peer direct x2, remote relayed x1"
    assert copy_paths({}) == ""


def test_copy_rate_falls_back_to_the_transfer_phase() -> None:
    report = {"bytes_from_peers": 300, "bytes_from_remote": 0, "phases": {"transfer": 3.0}}
    rate, how = copy_rate(report, remote=False)
    assert rate == 100.0 and "transfer phase" in how
    assert copy_rate(report, remote=True)[0] is None


def test_settings_from_the_environment() -> None:
    assert remote_bytes_per_s({}) == 300e6
    assert remote_bytes_per_s({"AUTOHET_BENCH_REMOTE_MBPS": "1250"}) == 1250e6
    for bad in ("0", "-3", "fast", "nan", "inf"):
        with pytest.raises(SystemExit, match="AUTOHET_BENCH_REMOTE_MBPS"):
            remote_bytes_per_s({"AUTOHET_BENCH_REMOTE_MBPS": bad})
    assert repeats({}) == 3
    assert repeats({"AUTOHET_BENCH_REPEATS": "1"}) == 1
    with pytest.raises(SystemExit, match="AUTOHET_BENCH_REPEATS"):
        repeats({"AUTOHET_BENCH_REPEATS": "0"})


def test_sizes_default_to_both_models_and_keep_the_disk_benchmark() -> None:
    from benchmarks.recovery_e2e import selected_sizes

    assert selected_sizes(None) == ["toy", "200m"]
    assert selected_sizes("200m-disk, toy") == ["200m-disk", "toy"]
    with pytest.raises(SystemExit, match="unknown 1b"):
        selected_sizes("toy,1b")


def _run_record(**kw: float | None) -> dict[str, object]:
    base: dict[str, object] = {
        "detect": 2.0,
        "replan": 1.0,
        "transfer": 4.0,
        "restart": 5.0,
        "load": 1.0,
        "first_step": 0.5,
        "total": 13.5,
        "bytes_peers": 1.6e9,
        "bytes_remote": 0.0,
        "bytes_checkpoint": 2.4e9,
        "peer_rate": 0.4e9,
        "peer_rate_how": "per file, from recover",
        "remote_rate": None,
        "killed_after_step": 6,
        "resumed_step": 6,
        **dict.fromkeys(("prep", "launch", "imports", "process_group", "build"), 0.1),
    }
    return base | kw


def test_the_report_prints_rates_projection_and_targets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.recovery_e2e_report import report

    results = {
        "autohet": [_run_record(), _run_record(total=15.5)],
        "remote-only": [
            _run_record(
                bytes_peers=0.0,
                bytes_remote=3.2e9,
                transfer=30.0,
                total=39.5,
                peer_rate=None,
                remote_rate=0.1e9,
            )
        ],
    }
    report("200m", results, remote_bytes_per_s=300e6, link_bytes_per_s=1.1e9)
    out = capsys.readouterr().out
    assert "2.40 GB per save" in out
    assert "300 MB/s (AUTOHET_BENCH_REMOTE_MBPS)" in out
    assert "autohet 14.5 s, remote-only 39.5 s: 2.72x faster" in out
    # remote-only with 3.2 GB at 300 MB/s instead of its 30 s transfer: 20.17 s
    assert "20.2 s: autohet 1.39x faster" in out
    # the target takes one pair alone; the per-file rate during recovery is shown beside
    assert "peer rate (one pair of hosts alone): 1.10 >= 1 GB/s: PASS" in out
    assert "per file during recovery, every destination at once, 0.40 GB/s" in out
    assert "projection with the parts measured at the real size (one H200 host" in out
    assert "200m kill to first step: 14.50 <= 15 s: PASS" in out
    assert "projected speedup at real size" in out


def test_real_parts_replace_restart_load_and_first_step_and_keep_the_shares() -> None:
    """The projection with a GPU host's measured parts: the loopback run's restart,
    load and first step are dropped; its bytes' shares and the links carry over."""
    parts = RealParts(
        where="x", checkpoint_bytes=16e9, restart_s=19.0, load_s=5.0, first_step_s=3.0
    )
    way = MeasuredWay(fixed_s=99.0, load_s=99.0, bytes_from_peers=1.0e9, bytes_from_remote=0.5e9)
    got = project_with(way, detect_replan_s=1.5, measured_bytes=2.0e9, parts=parts, real=RealSize())
    assert got.fixed_s == pytest.approx(1.5 + 19.0 + 3.0)
    assert got.load_s == 5.0
    assert got.peer_bytes == pytest.approx(8e9) and got.remote_bytes == pytest.approx(4e9)
    assert got.transfer_s == pytest.approx(8e9 / (25 * GBIT) + 4e9 / (2.5 * GBIT))
    assert got.total_s == pytest.approx(1.5 + 19.0 + 3.0 + 5.0 + got.transfer_s)
