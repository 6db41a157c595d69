"""One precision story (issue 46): ``profile run --precision`` reaches the probe and
the profile records it; plan, estimate and ``--measured-only`` say when the profile
measured the plan's combinations in another precision, and which flag uses them.

``profile run`` goes through a fake runner here (the real probe and hosts are the
e2e tier's): it keeps the spec it is sent and answers with a probe result in the
precision the spec asked for, as ``probe.py`` does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from autohet_cli import catalog
from autohet_cli.cli import profile as profile_cli
from autohet_cli.costmodel.evaluate import evaluate
from autohet_cli.errors import ConfigError, InfeasibleError
from autohet_cli.inputs import Inputs, load_inputs, tables_for
from autohet_cli.models import ModelSpec, get_model
from autohet_cli.plan import Device, Pipeline, Plan, Stage
from autohet_cli.planner.api import training_for
from autohet_cli.planner.explain import provenance, source_lines, summary_json
from autohet_cli.profiling import run as run_module
from autohet_cli.profiling.analytic import analytic_entry
from autohet_cli.profiling.measure import RESULT_SCHEMA
from autohet_cli.profiling.schema import Profile, load_profile
from autohet_cli.settings import TrainingSettings
from autohet_cli.transport.base import RunResult
from tests.planning import plan_inputs

ROOT = Path(__file__).resolve().parents[2]
LOCALHOST = str(ROOT / "profiles" / "clusters" / "localhost.yaml")
SMALL = str(ROOT / "profiles" / "clusters" / "small-mix.yaml")
SAILOR = load_profile(ROOT / "profiles" / "sailor" / "OPT-350M.yaml")
TINY = get_model("gpt-tiny")
OPT = get_model("OPT-350M")


# --- profile run --precision --------------------------------------------------------------


class FakeProbeHost:
    """A runner whose "probe" answers in the precision its spec asked (auto: bf16,
    as on a GPU that computes it natively)."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] = {}

    def __enter__(self) -> FakeProbeHost:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None

    def run(self, argv: list[str], **_: Any) -> RunResult:
        return RunResult(
            host="a100-0", argv=tuple(argv), exit_code=0, stdout="", stderr="", duration_s=0.0
        )

    def put(self, local: str | Path, remote: str) -> None:
        if remote.endswith("spec.json"):
            self.spec = json.loads(Path(local).read_text(encoding="utf-8"))

    def get(self, remote: str, local: str | Path) -> None:
        Path(local).write_text(json.dumps(probe_result(self.spec)), encoding="utf-8")


def probe_result(spec: dict[str, Any]) -> dict[str, Any]:
    """What probe.py writes for ``spec`` on an A100, every combination run."""
    layer = {"fwd_ms": 1.0, "bwd_ms": 2.0, "act_bytes": 1e6, "output_bytes": 1e5}
    return {
        "schema": RESULT_SCHEMA,
        "spec": spec,
        "dtype": "bf16" if spec["dtype"] == "auto" else spec["dtype"],
        "device": {"type": "cuda", "name": "NVIDIA A100-SXM4-40GB", "mem_bytes": 40 << 30},
        "matmul": {"tflops": 250.0, "n": 4096},
        "mem_bandwidth": {"gbytes_s": 1400.0},
        "host": {"hostname": "a100-0", "python": "3.11", "torch": "2.4.0"},
        "probe_version": "test",
        "runs": [
            {
                "tp": tp,
                "mbs": mbs,
                "status": "ok",
                "layers": {kind: {**layer, "num_params": 1000} for kind in spec["layers"]},
            }
            for tp in spec["tensor_parallel"]
            for mbs in spec["micro_batch_sizes"]
        ],
    }


def _cluster(tmp_path: Path) -> Path:
    path = tmp_path / "one.yaml"
    path.write_text(
        "schema: autohet.cluster/v1\nname: one\n"
        "hosts: [{name: a100-0, address: 10.0.0.11, gpus: {type: A100-40, count: 1}, "
        "workdir: /srv/autohet}]\n",
        encoding="utf-8",
    )
    return path


def _profile_run(*args: str | Path) -> Result:
    app = typer.Typer()
    profile_cli.register(app)
    return CliRunner().invoke(app, ["profile", "run", *(str(a) for a in args)])


def test_profile_run_precision_reaches_the_probe_and_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = FakeProbeHost()
    monkeypatch.setattr(run_module, "runner_for", lambda *a, **k: host)
    out = tmp_path / "p.yaml"
    common = ("--model", "gpt-tiny", "--tp", "1", "--micro-batch-sizes", "1,2")
    res = _profile_run(
        _cluster(tmp_path), *common, "--no-runtime-runs", "--out", out, "--precision", "fp16"
    )
    assert res.exit_code == 0, res.output
    assert host.spec["dtype"] == "fp16"  # what the probe was asked to time in
    profile = load_profile(out)
    assert {e.dtype for e in profile.entries.values()} == {"fp16"}
    assert profile.meta["history"][-1]["dtype"] == "fp16"
    # Not a plan's default: say which --precision uses these entries.
    assert "a100-0 measured in fp16: plan with --precision fp16 to use these entries" in (
        res.output
    )

    res = _profile_run(
        _cluster(tmp_path), *common, "--no-runtime-runs", "--out", tmp_path / "q.yaml", "--json"
    )
    assert res.exit_code == 0, res.output
    assert host.spec["dtype"] == "auto"  # the default: the probe picks per device
    report = json.loads(res.stdout)
    assert report["precision"] == "auto"
    assert report["hosts"]["a100-0"]["precision"] == "bf16"


def test_profile_run_refuses_16_bits_on_a_cpu_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(*_: Any, **__: Any) -> Any:
        pytest.fail("no host may be reached")

    monkeypatch.setattr(run_module, "runner_for", unreachable)
    res = _profile_run(LOCALHOST, "--model", "gpt-tiny", "--precision", "bf16")
    assert isinstance(res.exception, ConfigError)  # the app prints it as an error
    message = str(res.exception)
    assert "--precision bf16: localhost is a CPU host" in message
    assert "the runtime trains in fp32 on a CPU" in message
    assert "plan with --precision fp32" in message


# --- plan and estimate: the explanation -----------------------------------------------------


def _cpu_profile(dtype: str) -> Profile:
    """gpt-tiny "measured" on the CPU in ``dtype`` at every combination localhost offers."""
    entries = {}
    for tp in (1, 2):
        for mbs in (1, 2, 4, 8):
            e = analytic_entry(
                TINY,
                catalog.CATALOG["cpu"],
                tp=tp,
                micro_batch_size=mbs,
                seq_len=TINY.default_seq_len,
                precision=dtype,
                optimizer="adam",
            )
            entries[e.key] = replace(e, source="measured", dtype=dtype)
    return Profile(entries=entries)


def _one_stage_plan(gpu: str, host: str, model: ModelSpec) -> Plan:
    """All of ``model`` on one ``gpu`` at TP 1, micro-batch 1, in bf16."""
    stage = Stage(
        layer_start=0,
        layer_end=model.num_layers,
        gpu_type=gpu,
        tensor_parallel=1,
        devices=(Device(host=host, gpu=0),),
    )
    return Plan(
        name="precision",
        version=0,
        model_name=model.name,
        num_layers=model.num_layers,
        training=training_for(8, model.default_seq_len, "bf16", "adam"),
        tensor_parallel=1,
        pipelines=(Pipeline(num_microbatches=8, stages=(stage,)),),
        inputs={"model": {"name": model.name}},
    )


def test_explain_says_the_cpu_was_measured_in_fp32_and_the_plan_asks_bf16() -> None:
    inp = replace(load_inputs(LOCALHOST, TINY.name, []), profile=_cpu_profile("fp32"))
    plan = _one_stage_plan("cpu", "localhost", TINY)
    tables = tables_for(inp, plan.training)
    sources = provenance(plan, tables)
    (line,) = source_lines(sources)
    assert line.startswith("Stages 1 of 1 rest on unmeasured entries (cpu tp1 mbs1: ")
    assert (
        "the profile measured gpt-tiny on cpu in fp32, the plan asks bf16; plan with "
        "--precision fp32 to use them (the runtime trains in fp32 on a CPU" in line
    )
    assert "autohet profile run" not in line  # measuring again in auto changes nothing
    ev = evaluate(plan.pipelines, inp.cluster, tables, 1)
    out = summary_json(plan, ev, inp.cluster, None, sources=sources)
    assert out["unmeasured"][0]["measured_precision"] == "fp32"
    # In fp32 the same entries are measured: nothing to say.
    fp32 = replace(plan, training=replace(plan.training, precision="fp32"))
    assert source_lines(provenance(fp32, tables_for(inp, fp32.training))) == []


def test_explain_on_gpus_names_both_precisions_and_both_flags() -> None:
    fp16 = {k: replace(e, dtype="fp16") for k, e in SAILOR.entries.items()}
    inp = replace(
        load_inputs(SMALL, OPT.name, []), profile=Profile(devices=SAILOR.devices, entries=fp16)
    )
    plan = _one_stage_plan("A100-40", "a100-0", OPT)
    (line,) = source_lines(provenance(plan, tables_for(inp, plan.training)))
    assert (
        "the profile measured OPT-350M on A100-40 in fp16, the plan asks bf16; plan with "
        "--precision fp16 to use them, or measure them in bf16 with `autohet profile run "
        "CLUSTER --model OPT-350M --tp 1 --micro-batch-sizes 1 --precision bf16`." in line
    )


# --- --measured-only ------------------------------------------------------------------------


def _measured_only_refusal(inp: Inputs, training: TrainingSettings) -> str:
    """Why make_plan, allowed only the measured combinations, finds no plan."""
    with pytest.raises(InfeasibleError) as err:
        plan_inputs(inp, training, name="precision", time_limit_s=2.0, measured_only=True)
    return str(err.value)


def test_measured_only_names_the_precision_measured_and_the_flag() -> None:
    inp = replace(load_inputs(LOCALHOST, TINY.name, []), profile=_cpu_profile("fp32"))
    training = training_for(8, TINY.default_seq_len, "bf16", "adam")
    msg = _measured_only_refusal(inp, training)
    assert "Measured at seq_len 64, bf16: cpu: none." in msg
    assert (
        "The profile measured gpt-tiny on cpu in fp32, the plan asks bf16; plan with "
        "--precision fp32 to use them" in msg
    )


def test_measured_only_on_gpus_asks_to_measure_in_the_plans_precision() -> None:
    fp16 = {k: replace(e, dtype="fp16") for k, e in SAILOR.entries.items()}
    inp = replace(
        load_inputs(SMALL, OPT.name, []), profile=Profile(devices=SAILOR.devices, entries=fp16)
    )
    training = training_for(32, OPT.default_seq_len, "bf16", "adam")
    msg = _measured_only_refusal(inp, training)
    assert "the plan asks bf16; plan with --precision fp16 to use them." in msg
    assert "profile run CLUSTER --model OPT-350M --tp 1,2,4 --micro-batch-sizes 1,2,4,8 " in msg
    assert "--micro-batch-sizes 1,2,4,8 --precision bf16` and pass the profile" in msg


def test_profile_run_reads_the_cluster_files_known_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: a cluster file may name its known_hosts; profile run uses it too."""
    host = FakeProbeHost()
    seen: list[object] = []

    def runner_for(*_a: Any, **k: Any) -> Any:
        seen.append(k.get("known_hosts"))
        return host

    monkeypatch.setattr(run_module, "runner_for", runner_for)
    cluster = _cluster(tmp_path)
    cluster.write_text(cluster.read_text() + "known_hosts: kh\n", encoding="utf-8")
    common = ("--model", "gpt-tiny", "--tp", "1", "--micro-batch-sizes", "1")
    res = _profile_run(cluster, *common, "--no-runtime-runs", "--out", tmp_path / "p.yaml")
    assert res.exit_code == 0, res.output
    assert seen and set(seen) == {tmp_path / "kh"}
