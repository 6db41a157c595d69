"""Launch specs are pure: compare the generated commands with expected text exactly."""

from __future__ import annotations

import sys

import pytest

from autohet_cli.cluster import cluster_from_dict
from autohet_cli.launch.session import LaunchRequest, recover_argv
from autohet_cli.launch.specs import LaunchOptions, build_launch_specs
from tests.planting import plan_of, stage

CLUSTER = cluster_from_dict(
    {
        "schema": "autohet.cluster/v1",
        "name": "lab",
        "defaults": {"python": "/opt/venv/bin/python", "workdir": "/srv/autohet"},
        "hosts": [
            {"name": "a100-0", "address": "127.0.0.2", "gpus": {"type": "A100-40", "count": 4}},
            {"name": "v100-0", "address": "127.0.0.3", "gpus": {"type": "V100-16", "count": 4}},
            {"name": "cpu-0", "address": "127.0.0.4", "gpus": {"type": "cpu", "count": 2}},
        ],
    },
    "test",
)


# Pipeline 0 starts on the V100 host, so it is node 0 and the master; the A100 GPUs
# are used out of index order (3 then 1), which CUDA_VISIBLE_DEVICES must keep.
PLAN = plan_of(
    [stage(0, 3, "v100-0", 2, gpu_type="V100-16"), stage(3, 6, "a100-0", 3, gpu_type="A100-40")],
    [stage(0, 6, "a100-0", 1, gpu_type="A100-40")],
    microbatches=(5, 3),
    version=3,
)


def test_one_torchrun_per_host_with_static_rendezvous_at_the_first_host() -> None:
    specs = build_launch_specs(
        PLAN, CLUSTER, LaunchOptions(run_id="R1", master_port=29600, train_args=["--steps=20"])
    )
    assert [s.host for s in specs] == ["v100-0", "a100-0"]
    run = "/srv/autohet/runs/lab.v3/R1"
    v100, a100 = specs
    assert v100.argv == (
        "/opt/venv/bin/python",
        "-m",
        "autohet_cli.runtime.agent",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.3",
        "--master-port",
        "29600",
        "--max-restarts",
        "0",
        "-m",
        "autohet_cli.runtime.train",
        "--plan",
        f"{run}/lab.v3.yaml",
        "--run-dir",
        run,
        "--checkpoint-dir",
        "~/autohet/checkpoints",
        "--remote-storage",
        "none",
        "--steps=20",
    )
    assert a100.argv[5:8] == ("--node-rank", "1", "--nproc-per-node")
    assert a100.argv[8] == "2"
    assert a100.gpus == (3, 1)
    assert a100.env == {
        "AUTOHET_HOST": "a100-0",
        # where its replica receiver listens, and its failure domain (peer.replicate)
        "AUTOHET_HOST_ADDR": "127.0.0.2",
        "AUTOHET_FAILURE_DOMAIN": "A100-40/on-demand",
        "AUTOHET_PLAN": f"{run}/lab.v3.yaml",
        "AUTOHET_RUN_DIR": run,
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "3,1",
        "GLOO_SOCKET_IFNAME": "lo",
        # fragments the cost model cannot predict would make a full plan run out
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert a100.pid_file == f"{run}/torchrun-a100-0.pid"
    assert (v100.ranks, a100.ranks) == ((0,), (1, 2))  # torchrun numbers hosts in order
    assert v100.command_line() == (
        "cd /srv/autohet && env AUTOHET_FAILURE_DOMAIN=V100-16/on-demand AUTOHET_HOST=v100-0 "
        f"AUTOHET_HOST_ADDR=127.0.0.3 AUTOHET_PLAN={run}/lab.v3.yaml AUTOHET_RUN_DIR={run} "
        "CUDA_VISIBLE_DEVICES=2 "
        "GLOO_SOCKET_IFNAME=lo PYTHONUNBUFFERED=1 "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True /opt/venv/bin/python -m "
        "autohet_cli.runtime.agent --nnodes 2 --node-rank 0 --nproc-per-node 1 "
        "--master-addr 127.0.0.3 --master-port 29600 "
        f"--max-restarts 0 -m autohet_cli.runtime.train --plan {run}/lab.v3.yaml "
        f'--run-dir {run} --checkpoint-dir "$HOME"/autohet/checkpoints --remote-storage none '
        "--steps=20"
    )


def test_user_script_and_env_replace_the_built_in_trainer() -> None:
    (spec, _) = build_launch_specs(
        PLAN,
        CLUSTER,
        LaunchOptions(
            run_id="R",
            script=["my_train.py", "--epochs", "3"],
            user_env={
                "WANDB_MODE": "offline; rm -rf /",
                "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
            },
        ),
    )
    assert spec.env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # theirs wins
    assert spec.argv[-3:] == ("my_train.py", "--epochs", "3")
    assert "autohet_cli.runtime.train" not in spec.argv
    assert spec.env["WANDB_MODE"] == "offline; rm -rf /"
    assert "WANDB_MODE='offline; rm -rf /'" in spec.command_line()


def test_cpu_hosts_get_one_thread_per_worker_and_no_cuda_devices() -> None:
    plan = plan_of([stage(0, 6, "cpu-0")], name="cpu", precision="fp32")
    (spec,) = build_launch_specs(plan, CLUSTER, LaunchOptions(run_id="R"))
    assert spec.env["OMP_NUM_THREADS"] == "1" and "CUDA_VISIBLE_DEVICES" not in spec.env


def test_home_directories_expand_a_tilde_workdir() -> None:
    cluster = cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "h",
            "hosts": [
                {"name": "localhost", "address": "localhost", "gpus": {"type": "cpu", "count": 1}}
            ],
        },
        "t",
    )
    plan = plan_of([stage(0, 6, "localhost")], microbatches=1, name="h")
    (dry,) = build_launch_specs(plan, cluster, LaunchOptions(run_id="R"))
    assert dry.workdir == "~/autohet"
    (spec,) = build_launch_specs(plan, cluster, LaunchOptions(run_id="R"), {"localhost": "/h"})
    assert spec.workdir == "/h/autohet" and spec.run_dir == "/h/autohet/runs/h.v1/R"
    assert spec.argv[0] == sys.executable  # a local host runs this interpreter
    assert spec.argv[spec.argv.index("--master-addr") + 1] == "127.0.0.1"


@pytest.mark.parametrize(
    ("lost", "known_hosts", "expected"),
    [
        (("b",), None, "recover plans/x.v1.yaml --cluster c.yaml --lost b"),
        (
            ("b", "c d"),
            "k h",
            "recover plans/x.v1.yaml --cluster c.yaml --lost 'b,c d' --known-hosts 'k h'",
        ),
    ],
)
def test_recover_command_is_exact_and_quoted(
    lost: tuple[str, ...], known_hosts: str | None, expected: str
) -> None:
    import shlex
    from pathlib import Path

    from autohet_cli.transport.pool import ConnectOptions

    req = LaunchRequest(
        plan_file=Path("plans/x.v1.yaml"),
        cluster="c.yaml",
        connect=ConnectOptions(known_hosts=Path(known_hosts) if known_hosts else None),
    )
    assert shlex.join(recover_argv(req, lost)) == expected


def test_status_line_splits_tokens_per_s_by_batch_share() -> None:
    from autohet_cli.launch.hostlines import STEP_LINE, Status

    st = Status(shares=(5, 3))
    assert st.line() == "starting"
    m = STEP_LINE.search("step 12 loss 5.510221 tokens/s 8000")
    assert m is not None
    st.step, st.loss, st.tokens_per_s = int(m.group(1)), float(m.group(2)), float(m.group(3))
    assert st.line() == "step 12 loss 5.5102 | 8,000 tok/s = p0 5,000 + p1 3,000"


def test_dry_run_line_runs_as_printed_with_a_tilde_workdir(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """Pasted into sh on the host, the line cds into ~/autohet and passes expanded paths."""
    import subprocess
    from pathlib import Path

    tmp = Path(str(tmp_path))
    home = tmp / "home dir"
    (home / "autohet").mkdir(parents=True)
    fake_python = tmp / "fakepy"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "PWD=$PWD" "PLAN=$AUTOHET_PLAN" "$@"\n')
    fake_python.chmod(0o755)
    cluster = cluster_from_dict(
        {
            "schema": "autohet.cluster/v1",
            "name": "t",
            "defaults": {"python": str(fake_python)},
            "hosts": [
                {
                    "name": "h0",
                    "address": "127.0.0.2",
                    "gpus": {"type": "cpu", "count": 1},
                    "checkpoint_dir": "~/ck",
                }
            ],
        },
        "t",
    )
    plan = plan_of([stage(0, 6, "h0")], microbatches=1, name="t")
    (spec,) = build_launch_specs(plan, cluster, LaunchOptions(run_id="R"))
    line = spec.command_line()
    assert "'~" not in line  # a quoted ~ would not expand
    out = subprocess.run(
        ["sh", "-c", line],
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == f"PWD={home}/autohet"
    assert out[1] == f"PLAN={home}/autohet/runs/t.v1/R/t.v1.yaml"
    assert out[out.index("--plan") + 1] == f"{home}/autohet/runs/t.v1/R/t.v1.yaml"
    assert out[out.index("--checkpoint-dir") + 1] == f"{home}/ck"
