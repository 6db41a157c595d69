"""`autohet plan` and `autohet estimate` end to end through the real entry point."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from autohet_cli.plan import load_plan
from tests.cli import autohet as run_autohet

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "profiles" / "clusters" / "small-mix.yaml")
OPT_PROFILE = str(ROOT / "profiles" / "sailor" / "OPT-350M.yaml")


def autohet(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_autohet(*args, cwd=cwd, timeout=240)


# OPT-350M on small-mix with Sailor's profile
SMALL_OPT = ("--cluster", SMALL, "--model", "OPT-350M", "--profile", OPT_PROFILE)
# The plan both the fixture and the re-plan test make: small-mix, OPT-350M, batch 32.
PLAN_SMALL_JSON = ("plan", *SMALL_OPT, "--global-batch-size", "32", "--time-limit", "10")
PLAN_SMALL_JSON += ("--json", "--out-dir", "out")


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    work = tmp_path_factory.mktemp("plan")
    res = autohet(*PLAN_SMALL_JSON, cwd=work)
    assert res.returncode == 0, res.stderr
    return work, json.loads(res.stdout)


def test_plan_json_has_the_contract_fields(planned: tuple[Path, dict[str, object]]) -> None:
    work, out = planned
    for key in (
        "plan_path",
        "iteration_time_s",
        "tokens_per_s",
        "memory_peak_fraction",
        "solver",
        "baselines",
    ):
        assert key in out
    solver = out["solver"]
    assert isinstance(solver, dict) and {"status", "gap", "time_s"} <= solver.keys()
    baselines = out["baselines"]
    assert isinstance(baselines, dict) and "megatron" in baselines and "whale" in baselines
    path = work / str(out["plan_path"])
    assert path.name == "small-mix-OPT-350M.v1.yaml"  # default name: <cluster>-<model>
    plan = load_plan(path)
    assert plan.prediction is not None
    assert plan.prediction.iteration_time_s == pytest.approx(out["iteration_time_s"], rel=1e-5)
    assert plan.inputs["cluster"]["sha256"]
    for value in baselines.values():
        assert value is None or value >= float(out["iteration_time_s"]) * (1 - 1e-6)


def test_a_second_plan_is_a_new_version_unless_it_is_the_same(
    planned: tuple[Path, dict[str, object]],
) -> None:
    """Planning again from the same inputs keeps the version that is this plan (issue 46:
    `make demo` twice wrote identical v1 and v2); another result is the next version,
    and no version is ever rewritten."""
    work, first = planned
    before = (work / str(first["plan_path"])).read_bytes()
    res = autohet(*PLAN_SMALL_JSON, cwd=work)
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again["plan_path"].endswith("small-mix-OPT-350M.v1.yaml") and again["unchanged"]
    assert not (work / "out" / "small-mix-OPT-350M.v2.yaml").exists()
    other = [*PLAN_SMALL_JSON]
    other[other.index("32")] = "64"  # another global batch: another plan
    res = autohet(*other, cwd=work)
    assert res.returncode == 0, res.stderr
    new = json.loads(res.stdout)
    assert new["plan_path"].endswith("small-mix-OPT-350M.v2.yaml") and not new["unchanged"]
    assert (work / str(first["plan_path"])).read_bytes() == before


def test_explain_names_stages_binding_and_baselines(tmp_path: Path) -> None:
    args = (*SMALL_OPT, "--global-batch-size", "16", "--time-limit", "10", "--explain")
    res = autohet("plan", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for needle in (
        "Pipeline",
        "layers",
        "mem %",
        "bubble",
        "Binding:",
        "Solver:",
        "megatron",
        "speed-up",
        "per 1M tokens",
        "wrote plans/small-mix-OPT-350M.v1.yaml",
    ):
        assert needle in text, needle
    # the runtime-family note (OPT is not a built-in family) is printed once, among
    # the plan's notes, not also on stderr before the plan (issue 31)
    both = res.stdout + res.stderr
    assert both.count("the built-in runtime trains the families") == 1, both
    assert "Note: the built-in runtime trains" in res.stdout


def test_estimate_reads_a_plan_and_agrees(planned: tuple[Path, dict[str, object]]) -> None:
    work, out = planned
    res = autohet("estimate", str(out["plan_path"]), "--json", cwd=work)
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    assert est["iteration_time_s"] == pytest.approx(out["iteration_time_s"], rel=1e-6)
    assert est["tokens_per_s"] == pytest.approx(out["tokens_per_s"], rel=1e-6)


def test_estimate_judges_a_hand_edited_plan(planned: tuple[Path, dict[str, object]]) -> None:
    work, out = planned
    text = (work / str(out["plan_path"])).read_text()
    edited = work / "hand.yaml"
    # A hand-made plan need not carry predictions or solver output.
    import yaml

    data = yaml.safe_load(text)
    for key in ("prediction", "solver", "baselines"):
        data.pop(key)
    for p in data["pipelines"]:
        for s in p["stages"]:
            s.pop("predicted")
    edited.write_text(yaml.safe_dump(data))
    res = autohet("estimate", str(edited), "--json", cwd=work)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["iteration_time_s"] == pytest.approx(
        out["iteration_time_s"], rel=1e-6
    )


def test_infeasible_model_is_a_clean_error(tmp_path: Path) -> None:
    args = ("--model", "LLaMA-2-70B", "--global-batch-size", "8", "--time-limit", "5")
    res = autohet("plan", *args, cwd=tmp_path)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert re.search(r"need 1\.\d\d TB, the cluster has \d+\.\d\d GB", res.stderr), res.stderr
    assert not (tmp_path / "plans").exists() or not list((tmp_path / "plans").iterdir())


def test_bad_cluster_file_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "schema: autohet.cluster/v1\nname: x\nhosts:\n"
        "  - {name: a, gpus: {type: A100-40, cuont: 2}}\n"
    )
    res = autohet(
        "plan",
        "--cluster",
        str(bad),
        "--model",
        "gpt-tiny",
        "--global-batch-size",
        "4",
        cwd=tmp_path,
    )
    assert res.returncode == 1
    assert "bad.yaml" in res.stderr and "cuont" in res.stderr and "Traceback" not in res.stderr


def test_unknown_model_lists_the_zoo(tmp_path: Path) -> None:
    res = autohet("plan", "--model", "GPT-5", "--global-batch-size", "4", cwd=tmp_path)
    assert res.returncode == 1
    assert "unknown model" in res.stderr and "LLaMA-2-7B" in res.stderr


def test_a_model_typo_gets_a_did_you_mean(tmp_path: Path) -> None:
    res = autohet("plan", "--model", "OPT-350N", "--global-batch-size", "4", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "unknown model 'OPT-350N'; did you mean OPT-350M?" in res.stderr


TINY_LOCAL = ("--model", "gpt-tiny", "--global-batch-size", "4", "--precision", "fp32")


def test_plans_of_different_models_on_one_cluster_get_different_names(tmp_path: Path) -> None:
    names = []
    for model in ("gpt-tiny", "gpt-small"):
        args = ("--model", model, "--global-batch-size", "4", "--precision", "fp32")
        res = autohet("plan", *args, "--time-limit", "5", "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        names.append(Path(json.loads(res.stdout)["plan_path"]).name)
    assert names == ["localhost-gpt-tiny.v1.yaml", "localhost-gpt-small.v1.yaml"]


def test_cluster_localhost_is_the_embedded_cluster(tmp_path: Path) -> None:
    res = autohet(
        "plan", "--cluster", "localhost", *TINY_LOCAL, "--time-limit", "5", "--json", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    plan_path = json.loads(res.stdout)["plan_path"]
    assert {d.host for d in load_plan(tmp_path / plan_path).devices()} == {"localhost"}
    res = autohet("estimate", plan_path, "--cluster", "localhost", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def test_the_solver_line_says_what_is_proven_and_estimate_solves_nothing(
    tmp_path: Path,
) -> None:
    res = autohet("plan", *TINY_LOCAL, "--time-limit", "5", "--explain", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    solver = next(line for line in res.stdout.splitlines() if line.startswith("Solver: "))
    assert re.search(r"SCIP proved this grouping optimal|SCIP's gap on this grouping", solver)
    assert re.search(r"\d+\.\d\d s, \d+ groupings? solved", solver), solver
    assert "vs. the bound" not in res.stdout
    for line in res.stdout.splitlines():
        if line.startswith("Bound: "):
            # what is proven, in seconds, beside this plan's own time
            m = re.search(
                r"proven that no plan on this cluster runs an iteration in under "
                r"([\d.]+) (s|ms|us) \(this plan: ([\d.]+) (s|ms|us)\)",
                line,
            )
            unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
            assert m and float(m[1]) * unit[m[2]] < float(m[3]) * unit[m[4]], line
            assert "weak lower bound" not in line
    plan_path = next(iter((tmp_path / "plans").glob("*.yaml")))
    est = autohet("estimate", str(plan_path), cwd=tmp_path)
    assert est.returncode == 0, est.stderr
    assert "Solver:" not in est.stdout and "When planned: " in est.stdout
    assert not re.search(r"\d+\.\d\d s\b", est.stdout.split("When planned:")[1].splitlines()[0])


def test_localhost_default_cluster_plans_the_tiny_gpt(tmp_path: Path) -> None:
    args = ("--model", "gpt-tiny", "--global-batch-size", "8", "--precision", "fp32")
    res = autohet("plan", *args, "--time-limit", "5", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    plan = load_plan(tmp_path / out["plan_path"])
    assert {d.host for d in plan.devices()} == {"localhost"}
    assert plan.training.precision == "fp32"


def test_launch_refuses_a_plan_made_for_another_cluster_file(tmp_path: Path) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(Path(ROOT / "profiles" / "clusters" / "localhost.yaml").read_text())
    res = autohet(
        "plan", "--cluster", str(cluster), *TINY_LOCAL, "--time-limit", "5", "--json", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)["plan_path"]
    cluster.write_text(cluster.read_text() + "# edited after planning\n")
    res = autohet("launch", plan, "--dry-run", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "sha256" in res.stderr and "re-plan" in res.stderr and "--force" in res.stderr
    res = autohet("launch", plan, "--dry-run", "--force", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "autohet_cli.runtime.agent" in res.stdout


def test_zero1_plans_carry_the_flag_and_estimate_the_smaller_optimizer_state(
    tmp_path: Path,
) -> None:
    res = autohet(*PLAN_SMALL_JSON, "--zero1", "--name", "z", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    path = tmp_path / str(out["plan_path"])
    plan = load_plan(path)
    assert plan.training.zero1 and len(plan.pipelines) > 1
    import yaml

    data = yaml.safe_load(path.read_text())
    assert data["training"]["zero1"] is True
    sharded = json.loads(autohet("estimate", str(path), "--json", cwd=tmp_path).stdout)
    assert sharded["iteration_time_s"] == pytest.approx(out["iteration_time_s"], rel=1e-6)
    del data["training"]["zero1"]
    replicated = tmp_path / "replicated.yaml"
    replicated.write_text(yaml.safe_dump(data))
    res = autohet("estimate", str(replicated), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plain = json.loads(res.stdout)
    # the same plan keeps all of Adam's moments on every replica without ZeRO-1
    assert plain["memory_peak_fraction"] > sharded["memory_peak_fraction"]


def test_the_bound_line_says_what_is_proven_in_seconds() -> None:
    from autohet_cli.plan import SolverInfo
    from autohet_cli.planner.explain import solver_lines

    sv = SolverInfo(status="heuristic", gap=0.0, time_s=3.0, search_gap=0.71)
    [_, bound] = solver_lines(sv, iteration_s=1.215)
    assert bound.startswith(
        "Bound: proven that no plan on this cluster runs an iteration in under 352 ms "
        "(this plan: 1.215 s)."
    ), bound
    [_, small] = solver_lines(sv, iteration_s=0.0023)
    assert "under 667 us (this plan: 2.3 ms)" in small, small
    assert "weak lower bound" not in bound and "71% below" not in bound
    assert "likely much closer to this one" in bound
    [_, no_time] = solver_lines(sv)
    assert "under 29% of this plan's time" in no_time
