"""Relative paths given to `autohet launch`/`recover` (issue 31.1), through the CLI.

On this machine's hosts a relative ``--data``/``--init-from``/... is read from the
directory autohet runs in; on other hosts from the host's workdir, which the
dry run and the launch's first lines say. A path a host cannot read stops the
launch in its preflight, before any worker starts, in one line naming host,
flag and path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from autohet_cli.hfconfig import to_hf_config
from autohet_cli.launch.session import LaunchRequest, dry_run
from autohet_cli.models import get_model
from autohet_cli.plan import write_plan
from autohet_cli.yamlio import sha256_file
from tests.cli import autohet
from tests.planting import plan_of, stage
from tests.recovery_site import make_site


def localhost_plan(root: Path) -> Path:
    """A gpt-tiny plan on one CPU device of a localhost cluster whose directories are
    all under ``root`` (set HOME=root too: the workdir is ~/autohet)."""
    here = {"name": "localhost", "address": "localhost", "checkpoint_dir": str(root / "ckpt")}
    where = {"remote_storage": str(root / "remote")}
    return _cluster_plan(root / "cluster.yaml", "here", [{**here, "gpus": dict(CPU)}], **where)


CPU = {"type": "cpu", "count": 1}  # copied where used: yaml would write a repeat as an alias


def _cluster_plan(cluster: Path, name: str, hosts: list[dict[str, Any]], **extra: Any) -> Path:
    """A plan over ``hosts`` of cluster ``name``, whose file (``extra``: its other
    fields) is written to ``cluster``."""
    raw = {"schema": "autohet.cluster/v1", "name": name, "network": {"inter_node_gbps": 10}}
    cluster.write_text(yaml.safe_dump({**raw, **extra, "hosts": hosts}))
    return _plan(cluster.parent, cluster, tuple(h["name"] for h in hosts))


def _plan(root: Path, cluster: Path, hosts: tuple[str, ...]) -> Path:
    n = len(hosts)
    plan = plan_of(
        [stage(6 * i // n, 6 * (i + 1) // n, h) for i, h in enumerate(hosts)],
        precision="fp32",
        name="paths",
        inputs={"cluster": {"path": str(cluster), "sha256": sha256_file(cluster)}},
    )
    _, path = write_plan(plan, root / "plans")
    return path


def _remote_plan(root: Path) -> Path:
    """Two hosts that are not this machine (a dry run never connects to them)."""
    a = {"name": "a", "address": "10.9.0.1", "gpus": dict(CPU)}
    b = {"name": "b", "address": "10.9.0.2", "workdir": "/scratch/w", "gpus": dict(CPU)}
    return _cluster_plan(root / "remote.yaml", "far", [a, b])


def _elsewhere(root: Path) -> Path:
    cwd = root / "proj"
    cwd.mkdir()
    return cwd


def test_dry_run_shows_this_machines_paths_read_from_the_current_directory(
    tmp_path: Path,
) -> None:
    plan = localhost_plan(tmp_path)
    cwd = _elsewhere(tmp_path)
    # What the dry run's checks read there (launch.session.dry_check): all of it usable.
    (cwd / "build").mkdir()
    (cwd / "build" / "sample-tokens").write_bytes(bytes(2 * 1000))  # 1,000 uint16 ids
    (cwd / "my-llama").mkdir()
    config = to_hf_config(get_model("gpt-tiny"))
    (cwd / "my-llama" / "config.json").write_text(json.dumps(config))
    (cwd / "mine.py").write_text("def build(request): ...\n")
    res = autohet(
        *("launch", str(plan), "--dry-run", "--data", "build/sample-tokens"),
        *("--init-from", "my-llama", "--train-arg=--model-fn=mine.py:build"),
        cwd=cwd,
        env={"HOME": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    assert "dry run: checked 1 host(s)" in res.stderr and "nothing was started" in res.stderr
    out = res.stdout
    assert f"--data={cwd}/build/sample-tokens" in out
    assert f"--init-from={cwd}/my-llama" in out
    assert f"--model-fn={cwd}/mine.py:build" in out
    assert (
        f"# localhost: --data build/sample-tokens -> {cwd}/build/sample-tokens (relative paths "
        "on this machine are read from the current directory)"
    ) in out
    assert "--data=build/sample-tokens" not in out


def test_dry_run_shows_a_remote_hosts_paths_read_from_its_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the dry run prints (``session.dry_run``, no I/O); the CLI then checks on
    the hosts (launch.session.dry_check), which these hosts would not answer."""
    plan = _remote_plan(tmp_path)
    monkeypatch.chdir(_elsewhere(tmp_path))
    out = dry_run(
        LaunchRequest(
            plan_file=plan,
            train_args=("--data=build/x",),  # as the CLI's --data passes it
            init_from="~/m",
            sync_dir=Path("src"),
        )
    )
    assert '--data="$HOME"/autohet/build/x' in out  # runs as printed on host a
    assert '--init-from="$HOME"/m' in out
    assert "--data=/scratch/w/build/x" in out  # host b's workdir
    assert (
        "# a: --data build/x -> ~/autohet/build/x (relative paths on remote hosts are "
        "relative to the workdir)"
    ) in out
    assert f"# --sync-dir src -> {tmp_path}/proj/src (copied into each host's workdir" in out


def _fails_fast(res_args: tuple[str, ...], cwd: Path, home: Path) -> str:
    started = time.monotonic()
    res = autohet(*res_args, cwd=cwd, env={"HOME": str(home)}, timeout=120)
    took = time.monotonic() - started
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "rendezvous:" not in res.stdout  # no worker
    assert took < 60, took  # the preflight's few seconds, never a worker's traceback
    return res.stderr


def test_a_missing_relative_path_stops_the_launch_naming_host_flag_and_path(
    tmp_path: Path,
) -> None:
    plan = localhost_plan(tmp_path)
    cwd = _elsewhere(tmp_path)
    (cwd / "my-llama").mkdir()  # a directory, but without config.json
    (cwd / "run.yaml").write_text("data: tokens/nope\n")
    err = _fails_fast(
        ("launch", str(plan), "--data", "build/x", "--init-from", "my-llama"), cwd, tmp_path
    )
    assert (
        f"host localhost (localhost): --data build/x: no such file or directory (read as "
        f"{cwd}/build/x: relative paths on this machine are read from the current "
        "directory)"
    ) in err
    assert "host localhost (localhost): --init-from my-llama: no config.json in it" in err
    assert len(err.strip().splitlines()) == 1, err
    # The same flags from a run config and through --train-arg.
    err = _fails_fast(("launch", str(plan), "--config", "run.yaml"), cwd, tmp_path)
    assert "--data tokens/nope: no such file or directory" in err
    err = _fails_fast(("launch", str(plan), "--train-arg=--init-from=nowhere"), cwd, tmp_path)
    assert "--init-from nowhere: no such directory" in err
    err = _fails_fast(("launch", str(plan), "--sync-dir", "nope"), cwd, tmp_path)
    assert f"--sync-dir nope: no such directory (read as {cwd}/nope" in err
    err = _fails_fast(("launch", str(plan), "--config", "nope.yaml"), cwd, tmp_path)
    assert f"--config nope.yaml: no such run config file (read as {cwd}/nope.yaml)" in err


def test_recover_reads_relative_paths_like_launch(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    cwd = _elsewhere(tmp_path)
    (cwd / "tokens.bin").write_bytes(b"\0\0" * 1000)
    res = autohet(
        *("recover", str(site.plan_file), "--lost", "c", "--dry-run", "--data", "tokens.bin"),
        cwd=cwd,
        env={"HOME": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    for h in ("a", "b"):
        assert f"  paths on {h}: --data {cwd}/tokens.bin" in res.stdout, res.stdout
    res = autohet(
        *("recover", str(site.plan_file), "--lost", "c", "--dry-run", "--data", "tokens.bin"),
        "--json",
        cwd=cwd,
        env={"HOME": str(tmp_path)},
    )
    paths = json.loads(res.stdout)["paths"]
    assert paths == {h: {"--data": f"{cwd}/tokens.bin"} for h in ("a", "b")}
    err = _fails_fast(
        ("recover", str(site.plan_file), "--lost", "c", "--train-arg=--data=tok.bin"),
        cwd,
        tmp_path,
    )
    assert f"host a (localhost): --data tok.bin: no such file or directory (read as {cwd}/" in err


def test_a_plans_relative_cluster_path_read_from_elsewhere_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan keeps ``--cluster`` as typed; launched from another directory (or with
    a --cluster typo) the launch ended in a FileNotFoundError traceback."""
    from autohet_cli.errors import ConfigError
    from autohet_cli.launch.session import prepare

    plan = localhost_plan(tmp_path)
    raw = yaml.safe_load(plan.read_text())
    raw["inputs"]["cluster"]["path"] = "cluster.yaml"  # as `autohet plan --cluster cluster.yaml`
    plan.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(_elsewhere(tmp_path))
    with pytest.raises(ConfigError) as exc:
        prepare(plan, None)
    assert str(exc.value) == (
        "cluster.yaml: file not found (plan paths.v1's cluster file, named relative to "
        f"where it was planned; read from {tmp_path}/proj): run from the directory you "
        "planned in, or pass --cluster PATH"
    )
    with pytest.raises(ConfigError, match=r"^nosuch\.yaml: file not found$"):
        prepare(plan, "nosuch.yaml")
    monkeypatch.chdir(tmp_path)
    assert prepare(plan, None).cluster_path == "cluster.yaml"
