"""Reading Slurm's answers (pure): ``scontrol show node -o`` into a cluster file,
``scontrol show job -o`` into job states, GRES strings, node states."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autohet_cli.cluster import cluster_from_dict
from autohet_cli.errors import ConfigError
from autohet_cli.slurm.ctl import is_down, parse_fields, parse_scontrol_jobs
from autohet_cli.slurm.importer import gpu_gres, import_nodes

ROOT = Path(__file__).resolve().parents[2]


def _node(
    name: str, addr: str, gres: str = "(null)", parts: str = "gpu", state: str = "IDLE"
) -> str:
    return (
        f"NodeName={name} Arch=x86_64 CoresPerSocket=16  CPUAlloc=0 CPUTot=64 "
        f"AvailableFeatures=a100,ib ActiveFeatures=a100,ib Gres={gres} NodeAddr={addr} "
        f"NodeHostName={name} Version=22.05.8 OS=Linux 6.1 #1 SMP  RealMemory=512000 "
        f"State={state} Partitions={parts}  BootTime=2026-11-23T23:38:07 "
        "Reason=Not responding [slurm@2026-11-24T19:44:18]"
    )


NODES = "\n".join(
    [
        _node("a100-01", "10.1.0.1", "gpu:a100:4(S:0-1)"),
        _node("a100-02", "10.1.0.2", "gpu:a100:4(S:0-1),nic:1"),
        _node("v100-01", "10.1.0.3", "gpu:v100:8", parts="gpu,long"),
        _node("login-1", "10.1.0.9", parts="cpu"),
        _node("rtx-01", "10.1.0.4", "gpu:rtx3090:2", state="DOWN*"),
    ]
)


def test_gpu_nodes_become_hosts_with_gres_types_and_counts() -> None:
    got = import_nodes(NODES, name="lab")
    hosts = [
        (h["name"], h["address"], h["gpus"]["type"], h["gpus"]["count"]) for h in got.doc["hosts"]
    ]
    assert hosts == [
        ("a100-01", "10.1.0.1", "A100-40", 4),
        ("a100-02", "10.1.0.2", "A100-40", 4),
        ("v100-01", "10.1.0.3", "V100-16", 8),
        ("rtx-01", "10.1.0.4", "RTX-3090", 2),
    ]
    assert got.doc["backend"] == "slurm"
    assert got.doc["slurm"]["gpu_types"] == {
        "A100-40": {"gres": "a100"},
        "V100-16": {"gres": "v100"},
        "RTX-3090": {"gres": "rtx3090"},
    }
    notes = " | ".join(got.notes)
    assert "login-1: no GPU GRES; left out" in notes
    assert "rtx-01: state DOWN*" in notes
    assert "a100 taken as A100-40" in notes and "--gpu-type a100=TYPE" in notes
    cl = cluster_from_dict(got.doc, "x")  # a file autohet accepts as is
    assert cl.slurm.gpu_type("V100-16").gres == "v100"


def test_partition_filter_and_gpu_type_mapping() -> None:
    got = import_nodes(NODES, name="lab", partition="long", gpu_types={"v100": "V100-32"})
    assert [(h["name"], h["gpus"]["type"]) for h in got.doc["hosts"]] == [("v100-01", "V100-32")]
    assert got.doc["slurm"]["partition"] == "long"
    assert not [n for n in got.notes if "taken as" in n]


def test_cpu_nodes_are_taken_only_when_asked() -> None:
    got = import_nodes(_node("c1", "127.0.0.2", parts="debug"), name="t", cpu_devices=2)
    assert got.doc["hosts"] == [
        {"name": "c1", "address": "127.0.0.2", "gpus": {"type": "cpu", "count": 2}}
    ]
    with pytest.raises(ConfigError, match="no node with GPUs.*--cpu-devices"):
        import_nodes(_node("c1", "127.0.0.2"), name="t")


def test_unknown_gres_types_are_named_with_the_fix() -> None:
    text = _node("x1", "10.0.0.1", "gpu:mi250:8") + "\n" + _node("x2", "10.0.0.2", "gpu:mi250:8")
    with pytest.raises(ConfigError, match=r"mi250 on x1, x2.*--gpu-type GRES=TYPE"):
        import_nodes(text, name="t")
    got = import_nodes(text, name="t", gpu_types={"mi250": "A100-80"})
    assert {h["gpus"]["type"] for h in got.doc["hosts"]} == {"A100-80"}


def test_a_node_name_autohet_cannot_use_is_refused() -> None:
    with pytest.raises(ConfigError, match="NodeName 'bad/name'"):
        import_nodes(_node("bad/name", "10.0.0.1", "gpu:a100:1"), name="t")


@pytest.mark.parametrize(
    ("gres", "want"),
    [
        ("gpu:a100:4(S:0-1)", [("a100", 4)]),
        ("gpu:2", [(None, 2)]),
        ("gpu:a100:4,gpu:a10:1", [("a100", 4), ("a10", 1)]),
        ("nic:1,gpu:h100:8(S:0)", [("h100", 8)]),
        ("(null)", []),
        ("gpu:a100:0", []),
    ],
)
def test_gres_strings(gres: str, want: list[tuple[str | None, int]]) -> None:
    assert gpu_gres(gres) == want


def test_heterogeneous_job_states_per_component() -> None:
    text = (
        "JobId=7 HetJobId=7 HetJobOffset=0 JobName=autohet-e2e.v1 JobState=RUNNING "
        "Reason=None NodeList=sn1\n"
        "JobId=8 HetJobId=7 HetJobOffset=1 JobName=autohet-e2e.v1 JobState=NODE_FAIL "
        "Reason=NodeDown NodeList=sn2\n"
    )
    st = parse_scontrol_jobs(text)
    assert st.components == {"7+0": "RUNNING", "7+1": "NODE_FAIL"}
    assert st.nodes == {"7+0": "sn1", "7+1": "sn2"}
    assert st.running and not st.ended and not st.pending
    single = parse_scontrol_jobs("JobId=9 JobName=x JobState=COMPLETED Reason=None NodeList=sn1")
    assert single.components == {"9": "COMPLETED"} and single.ended


def test_values_with_spaces_stay_whole() -> None:
    f = parse_fields("NodeName=n1 Reason=Not responding [slurm@2026] State=DOWN*")
    assert f["Reason"] == "Not responding [slurm@2026]" and f["State"] == "DOWN*"


@pytest.mark.parametrize(
    ("state", "down"),
    [
        ("IDLE", False),
        ("ALLOCATED", False),
        ("MIXED", False),
        ("DOWN", True),
        ("DOWN*", True),
        ("IDLE*", True),
        ("ALLOCATED*", True),
        ("NOT_RESPONDING", True),
        ("DRAINING", False),
    ],
)
def test_node_down_states(state: str, down: bool) -> None:
    assert is_down(state) is down


@pytest.mark.parametrize(
    "addr", ["-oProxyCommand=touch /tmp/PWNED", "n1;id", "$(id)", "-p2222", "a`id`b"]
)
def test_a_node_address_that_is_no_host_name_or_ip_is_refused(addr: str) -> None:
    with pytest.raises(ConfigError) as exc:
        import_nodes(_node("n1", addr, "gpu:a100:4"), name="t")
    message = str(exc.value)
    assert "NodeAddr" in message and "n1" in message and "host name or an IP address" in message


@pytest.mark.parametrize("addr", ["localhost", "local", "LocalHost"])
def test_a_localhost_node_address_is_refused_unless_the_node_is_this_machine(addr: str) -> None:
    """``localhost`` makes a host local (run here, without SSH): right only on that node."""
    with pytest.raises(ConfigError, match=r"n1.*NodeAddr.*this machine \(login-1\)"):
        import_nodes(_node("n1", addr, "gpu:a100:4"), name="t", this_host="login-1")
    with pytest.raises(ConfigError, match=r"n1.*NodeAddr"):
        import_nodes(_node("n1", addr, "gpu:a100:4"), name="t")  # this machine unknown
    got = import_nodes(_node("n1", addr, "gpu:a100:4"), name="t", this_host="n1.lab.org")
    assert got.doc["hosts"][0]["address"] == addr
    assert any("n1: NodeAddr" in n and "this machine" in n for n in got.notes)


def test_a_loopback_node_address_is_noted() -> None:
    got = import_nodes(_node("sn1", "127.0.0.2", "gpu:a100:1"), name="t", this_host="ctl")
    assert got.doc["hosts"][0]["address"] == "127.0.0.2"
    assert any("sn1: NodeAddr 127.0.0.2 is a loopback address" in n for n in got.notes)


def _fake_scontrol(tmp_path: Path, output: bytes) -> dict[str, str]:
    """A directory on PATH whose ``scontrol`` prints ``output`` (bytes as they are)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "out").write_bytes(output)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\ncat '{bin_dir / 'out'}'\n")
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def _import(tmp_path: Path, output: bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autohet_cli", "cluster", "import", "--slurm", "--out", "c.yaml"],
        cwd=tmp_path,
        env=_fake_scontrol(tmp_path, output),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_non_utf8_bytes_in_scontrol_output_are_no_traceback(tmp_path: Path) -> None:
    """A Reason typed in Latin-1 is read (the fields autohet uses are checked); a node
    name that is not UTF-8 is refused by name, with no traceback."""
    reason = _node("a100-01", "10.1.0.1", "gpu:a100:4").encode() + b" Comment=caf\xe9\n"
    res = _import(tmp_path, reason)
    assert res.returncode == 0, res.stderr
    assert "a100-01 (10.1.0.1): 4 x A100-40" in res.stdout
    bad = _node("gpu\xff", "10.1.0.1", "gpu:a100:4").encode("latin-1") + b"\n"
    res = _import(tmp_path / "bin", bad)  # another folder: c.yaml is there
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "NodeName" in res.stderr and "not UTF-8" in res.stderr
