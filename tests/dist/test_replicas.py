"""Issue 30: after each save every host's shards also live on a partner host.

Three fake hosts (a, b, c), one gloo worker each, each with its own checkpoint
directory and its own loopback address (127.0.0.2-4, as ``autohet launch`` tells a
worker with ``AUTOHET_HOST_ADDR``), a 3-stage pipeline. After the run:

* every host's files of every kept step are on its partner, byte for byte, and the
  manifest (authenticated) records the partners;
* rank 0's host's partner also holds ``.metadata``, the manifest and COMPLETE, so
  losing any ONE host leaves a whole, loadable step on the other two: the survivors'
  directories alone (no remote copy) resume the run on its loss curve;
* ``--replica-budget`` smaller than a host's shards: nothing is sent to it, and
  the run says so; ``--replicas 0``: no copies at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_checkpoint import NAME, _args, _losses, _on_hosts, _run, _workers
from test_runtime_exact import NUM_LAYERS, make_plan

from autohet_cli.ckpt.files import read_key, sha256_file
from autohet_cli.ckpt.format import verified_manifest
from autohet_cli.plan import write_plan

pytestmark = pytest.mark.dist

HOSTS = "abc"
NS = Path(NAME) / "default"
STEPS_RUN = 4


def _plan_path(tmp: Path) -> Path:
    base = make_plan(NAME, [(3, [(0, 2), (2, 4), (4, NUM_LAYERS)])], optimizer="adam")
    return write_plan(_on_hosts(base, HOSTS), tmp / "plans")[1]


def _three_hosts(tmp: Path, *extra: str) -> tuple[dict[str, Path], list[str]]:
    """One worker per host, each with its own address and disk; their stderr."""
    dirs = {h: tmp / f"disk-{h}" for h in HOSTS}
    errs = _workers(
        _plan_path(tmp),
        STEPS_RUN,
        HOSTS,
        lambda host: [
            *("--checkpoint-dir", str(dirs[host]), "--checkpoint-every", "2"),
            *("--remote-storage", "none", *extra, "--run-dir", str(tmp / f"run-{host}")),
        ],
        lambda host: {
            "AUTOHET_HOST_ADDR": f"127.0.0.{HOSTS.index(host) + 2}",
            "AUTOHET_FAILURE_DOMAIN": "cpu/spot" if host == "c" else "cpu/on-demand",
        },
    )
    return dirs, errs


def _files(d: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.timeout(600)
def test_every_hosts_shards_live_on_a_partner_and_survivors_resume(tmp_path: Path) -> None:
    dirs, errs = _three_hosts(tmp_path)
    key = read_key(dirs["a"] / NS)
    assert key is not None
    step = "step-00000004"
    manifest = verified_manifest((dirs["a"] / NS / step / "manifest.json").read_text(), key, "")
    assert manifest.replicas is not None
    partners = manifest.replicas
    assert set(partners) == set(HOSTS)
    for host, ps in partners.items():
        assert len(ps) == 1 and ps[0] != host, (partners, errs[0][-3000:])  # why: no room?
        mine = {f.path: f.sha256 for f in manifest.files if f.host == host}
        held = _files(dirs[ps[0]] / NS / step)
        for name, sha in mine.items():
            assert held.get(name) == sha, (host, ps, name)
    # c (spot) is the other domain: a and b (on-demand) both prefer it, it takes one;
    # c's own partner is on-demand.
    assert partners["c"][0] in "ab"
    # rank 0's host a: its partner has a whole step's bookkeeping too.
    pa = dirs[partners["a"][0]] / NS / step
    assert {"manifest.json", "COMPLETE", ".metadata"} <= set(_files(pa))
    assert "replicas of step 4:" in errs[0] and "GB to partners" in errs[0]

    # Lose rank 0's host (manifest, .metadata, COMPLETE and rank 0's shards) or the
    # last one: the other two directories resume the run, no remote copy.
    full = _losses(tmp_path / "run-a" / "metrics.jsonl")
    one = make_plan(NAME, [(3, [(0, NUM_LAYERS)])], optimizer="adam")
    _, one_path = write_plan(one, tmp_path / "plans")
    for lost in "ac":
        root = tmp_path / f"survivors-without-{lost}"
        for h in HOSTS:
            if h != lost:
                shutil.copytree(dirs[h], root, dirs_exist_ok=True)
        proc = _run(
            _args(one_path, STEPS_RUN, "--resume", "2", "--checkpoint-dir", str(root))
            + ["--remote-storage", "none", "--checkpoint-every", "0"]
            + ["--metrics", str(tmp_path / f"m-{lost}.jsonl")]
        )
        assert f"resumed from {root / NS / 'step-00000002'} at step 2" in proc.stderr
        got = _losses(tmp_path / f"m-{lost}.jsonl")
        assert got[2] == pytest.approx(full[2], rel=1e-5), lost
        assert got[3] == pytest.approx(full[3], rel=1e-5), lost


@pytest.mark.timeout(600)
def test_budget_and_off(tmp_path: Path) -> None:
    dirs, errs = _three_hosts(tmp_path / "tiny", "--replica-budget", "1KB")
    step = "step-00000004"
    for h in HOSTS:  # no host keeps another's files: each shard exceeds 1 KB
        names = {p.name for p in (dirs[h] / NS / step).iterdir()}
        hosts_files = {n for n in names if n.endswith(".distcp")}
        ranks = {n.split("_")[2] for n in hosts_files}
        assert ranks == {str(HOSTS.index(h))}, (h, names)
    assert "have no room for" in errs[0] and "within the replica budget" in errs[0]

    dirs, errs = _three_hosts(tmp_path / "off", "--replicas", "0")
    for h in HOSTS:
        ranks = {n.name.split("_")[2] for n in (dirs[h] / NS / step).glob("*.distcp")}
        assert ranks == {str(HOSTS.index(h))}
    assert not any("replicas of step" in e for e in errs)
