"""A job that `autohet recover` can work on without training: three hosts on this
machine (local runners, one checkpoint directory each), a plan over them, and
signed checkpoint steps whose files are random bytes (recover moves and verifies
files; it never loads them), with a remote copy of each step."""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from autohet_cli.ckpt.format import KEY_FILE, Manifest, ManifestFile, signed_manifest_text
from autohet_cli.plan import write_plan
from autohet_cli.yamlio import sha256_file
from tests.planting import plan_of, stage

HOSTS = ("a", "b", "c")
JOB = "20260101T000000Z-abcd"


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    root: Path
    plan_file: Path
    key: bytes

    def step_dir(self, host: str, step: int) -> Path:
        return self.root / host / "ck" / "lab" / JOB / f"step-{step:08d}"

    def remote_dir(self, step: int) -> Path:
        return self.root / "remote" / "lab" / JOB / f"step-{step:08d}"

    def job_dir(self, host: str) -> Path:
        return self.root / host / "ck" / "lab" / JOB


def make_site(root: Path, steps: tuple[int, ...] = (3, 6)) -> Site:
    """Host ``a`` holds ``.metadata`` and rank 0's file, ``b`` rank 1's, ``c`` rank 2's;
    the remote copy holds them all. Plan ``lab.v1`` runs one stage per host."""
    cluster = {
        "schema": "autohet.cluster/v1",
        "name": "t",
        "network": {"inter_node_gbps": 10},
        "remote_storage": str(root / "remote"),
        "hosts": [
            {
                "name": h,
                "address": "localhost",
                "gpus": {"type": "cpu", "count": 1},
                "checkpoint_dir": str(root / h / "ck"),
                "workdir": str(root / h / "work"),
            }
            for h in HOSTS
        ],
    }
    cluster_file = root / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(cluster))
    plan = plan_of(
        [stage(2 * i, 2 * i + 2, h) for i, h in enumerate(HOSTS)],
        microbatches=3,
        inputs={"cluster": {"path": str(cluster_file), "sha256": sha256_file(cluster_file)}},
    )
    _, plan_file = write_plan(plan, root / "plans")
    site = Site(root=root, plan_file=plan_file, key=secrets.token_bytes(32))
    for step in steps:
        _write_step(site, step)
    for h in HOSTS:
        site.job_dir(h).chmod(0o700)
        key = site.job_dir(h) / KEY_FILE
        key.write_bytes(site.key)
        key.chmod(0o600)
    return site


def _write_step(site: Site, step: int) -> None:
    owners = [("a", ".metadata", 0), *((h, f"__{r}_0.distcp", r) for r, h in enumerate(HOSTS))]
    files = []
    for host, name, rank in owners:
        blob = os.urandom(4096)
        for d in (site.step_dir(host, step), site.remote_dir(step)):
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(blob)
        digest = hashlib.sha256(blob).hexdigest()
        files.append(
            ManifestFile(path=name, sha256=digest, num_bytes=len(blob), host=host, rank=rank)
        )
    manifest = Manifest(
        step=step, plan="lab.v1", plan_sha256="0" * 64, world_size=3, files=tuple(files)
    )
    text = signed_manifest_text(manifest, site.key)
    for d in [*(site.step_dir(h, step) for h in HOSTS), site.remote_dir(step)]:
        (d / "manifest.json").write_text(text)
        (d / "COMPLETE").write_text("")
