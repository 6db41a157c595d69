"""`autohet profile run` on this machine's CPU cluster, then `autohet plan` from it
(the probes and runtime runs start gloo workers: this tier, not the unit tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autohet_cli.profiling.schema import load_profile
from tests.cli import autohet

ROOT = Path(__file__).resolve().parents[2]
LOCALHOST = str(ROOT / "profiles" / "clusters" / "localhost.yaml")


@pytest.mark.slow(
    "profiles a 2-device cluster: probes, then the runtime at DP 2, TP 2, 2 stages, sharded"
)
def test_profile_the_cpu_cluster_then_plan_from_it(tmp_path: Path) -> None:
    out = tmp_path / "cpu.yaml"
    res = autohet(
        "profile",
        "run",
        LOCALHOST,
        "--model",
        "gpt-tiny",
        "--tp",
        "1,2",
        "--micro-batch-sizes",
        "1,2",
        "--out",
        str(out),
        "--json",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["hosts"]["localhost"]["ok"] is True
    # --precision auto: a CPU is timed in fp32, what the runtime trains in there.
    assert report["precision"] == "auto"
    assert report["hosts"]["localhost"]["precision"] == "fp32"
    profile = load_profile(out)
    assert {e.dtype for e in profile.entries.values()} == {"fp32"}
    assert profile.meta["hosts"] == ["localhost"]
    assert "torch" in json.dumps(profile.meta)  # software versions recorded
    keys = {(k.gpu_type, k.tensor_parallel, k.micro_batch_size) for k in profile.entries}
    assert keys == {("cpu", 1, 1), ("cpu", 1, 2), ("cpu", 2, 1), ("cpu", 2, 2)}
    # The runtime ran data parallel 2, TP 2 and two stages at the largest micro-batch
    # size; the profile was refitted from those runs, the other size by their ratios.
    runs = report["runtime_runs"]["localhost"]
    assert [(r["shape"], r["status"], r["micro_batch_size"]) for r in runs] == [
        ("data-parallel-2", "ran", 2),
        ("tp-2", "ran", 2),
        ("two-stages", "ran", 2),
        ("sharded-weights-2", "ran", 2),
    ]
    assert all(r["measured_step_ms"] > 0 and r["predicted_step_ms"] > 0 for r in runs)
    assert {e.source for e in profile.entries.values()} == {"calibrated"}
    overhead = profile.overheads["cpu"]
    assert overhead.runs == 3 and overhead.p2p_ms >= 0
    # The sharded run (issue 48) refit the factor on FSDP's gathers and reduce-scatters
    # (gloo on a CPU: nothing overlaps, so they are exposed) and nothing else.
    assert overhead.shard_x != 1.0, overhead
    # The fixed per-step cost is what the one TP-1 run without a pipeline measured
    # beyond its stage times (the TP run refits TP's addition, the pipelined run the
    # exchange latency). It may be 0 on a loaded machine, where noise hides it, so the
    # test checks where it came from rather than its size.
    assert runs[0]["step_overhead_ms"] >= 0
    assert overhead.step_ms == pytest.approx(runs[0]["step_overhead_ms"], rel=1e-6, abs=1e-6)
    assert len(profile.meta["calibrated_from"]) == 4
    # The runs cleaned up after themselves: no run directory, no job key left behind.
    for absorbed in profile.meta["calibrated_from"]:
        _, host, shape, rid = absorbed.split(":")
        assert host == "localhost"
        assert not (Path.home() / "autohet/runs" / f"runcheck-{shape}.v1" / rid).exists()
        assert not (
            Path.home() / "autohet/checkpoints" / f"runcheck-{shape}" / f"rc-{rid}"
        ).exists()
    res = autohet(
        "plan",
        "--model",
        "gpt-tiny",
        "--global-batch-size",
        "4",
        "--precision",
        "fp32",
        "--profile",
        str(out),
        "--time-limit",
        "5",
        "--json",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["iteration_time_s"] > 0


def test_profiling_again_merges_into_the_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "cpu.yaml"
    # The second run names the embedded cluster as help says: localhost, not a path.
    for mbs, cluster in (("1", LOCALHOST), ("2", "localhost")):
        res = autohet(
            "profile",
            "run",
            cluster,
            "--model",
            "gpt-tiny",
            "--tp",
            "1",
            "--micro-batch-sizes",
            mbs,
            "--no-runtime-runs",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr
    keys = {k.micro_batch_size for k in load_profile(out).entries}
    assert keys == {1, 2}


def test_unknown_host_filter_is_a_clear_error(tmp_path: Path) -> None:
    res = autohet(
        "profile", "run", LOCALHOST, "--model", "gpt-tiny", "--hosts", "nope", cwd=tmp_path
    )
    assert res.returncode == 1
    assert "--hosts: nope not in cluster" in res.stderr and "Traceback" not in res.stderr


def test_a_host_of_a_defined_type_is_measured_under_that_type(tmp_path: Path) -> None:
    """The host's type reaches the probe's check: here the CPU-only host declared as
    an A6000 is refused, rather than filing CPU timings under the A6000's name."""
    cluster = tmp_path / "ws.yaml"
    cluster.write_text(
        "schema: autohet.cluster/v1\nname: ws\n"
        "gpu_types: {A6000: {mem_gb: 48, peak_tflops: 154.8, mem_bandwidth_gbytes_s: 768}}\n"
        "hosts: [{name: localhost, address: localhost, gpus: {type: A6000, count: 1}}]\n"
    )
    args = ("--model", "gpt-tiny", "--tp", "1", "--micro-batch-sizes", "1", "--no-runtime-runs")
    res = autohet("profile", "run", str(cluster), *args, "--out", "p.yaml", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "gpus.type A6000 but the probe found no GPU" in res.stderr
    assert not (tmp_path / "p.yaml").exists()
