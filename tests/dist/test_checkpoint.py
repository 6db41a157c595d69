"""Checkpoints through the real worker entry point: layout, manifest, remote copy, resume.

One 4-worker run saves (``--checkpoint-every 2``, 4 steps) under a plan of two
pipelines with different stage cuts spread over two fake hosts ``a`` and ``b``,
each with its own checkpoint directory, as ``autohet launch`` would start them
(``AUTOHET_HOST``, one ``--checkpoint-dir`` per host). The tests then check what
docs/checkpoint-format.md promises and resume under other plans: one pipeline
with TP 2 and another cut (4 workers), and the one-device plan (no torchrun).
Every loss must match the uninterrupted single-process run within 1e-5
(relative), AdamW included: the per-step losses of a resumed run continue the
curve, across TP degrees and stage cuts. Every run trains on real text with
clipping, warmup and cosine decay (``realdata``), so the optimizer state, the
learning rate and the data position all have to survive the change of plan.

Resuming needs each loading host's step directory to hold the files its ranks
read; ``autohet recover`` arranges that by copying, which the tests do by hand.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from realdata import data_flags
from test_runtime_exact import NUM_LAYERS, ROOT, _env, make_plan
from zygote import run_workers

from autohet_cli.ckpt.checkpointer import sha256_file
from autohet_cli.plan import Device, Plan, write_plan
from autohet_cli.recovery.manifest import load_manifest
from autohet_cli.recovery.transfer import needed_files

pytestmark = pytest.mark.dist

SEED, LR, STEPS = "7", "0.001", 6
TIMEOUT_S = 300  # 7 workers of a CUDA build of torch (the torch-range runs) on 2 cores
NAME = "ckpt"  # every plan below shares it, so they share the checkpoints
NS = Path(NAME) / "default"  # the job namespace of workers started without the launcher
STEP_2, STEP_4 = "step-00000002", "step-00000004"


def _on_hosts(base: Plan, hosts: str) -> Plan:
    """``base`` with stage j of every pipeline on host ``hosts[j]``, GPU = pipeline index."""
    return replace(
        base,
        pipelines=tuple(
            replace(
                p,
                stages=tuple(
                    replace(s, devices=(Device(host=hosts[j], gpu=i),))
                    for j, s in enumerate(p.stages)
                ),
            )
            for i, p in enumerate(base.pipelines)
        ),
    )


def _two_host_plan() -> Plan:
    """Pipelines [0,2)+[2,6] (3 micro-batches) and [0,4)+[4,6) (5): stage 0 on a, 1 on b.
    Ranks (one agent per host): 0 [0,2) and 1 [0,4) on a, 2 [2,6) and 3 [4,6) on b."""
    base = make_plan(NAME, [(3, [(0, 2), (2, 6)]), (5, [(0, 4), (4, 6)])], optimizer="adam")
    return _on_hosts(base, "ab")


def _args(plan_path: Path, steps: int, *extra: str) -> list[str]:
    return [
        *("-m", "autohet_cli.runtime.train", "--plan", str(plan_path), "--steps", str(steps)),
        *("--seed", SEED, "--lr", LR, "--device", "cpu", *data_flags(), *extra),
        # Every run, the saving one too, is the STEPS-step run: one schedule for all.
        *("--decay-steps", str(STEPS)),
    ]


def _losses(metrics: Path) -> dict[int, float]:
    lines = map(json.loads, metrics.read_text().splitlines())
    return {m["step"]: m["loss"] for m in lines if "loss" in m}  # not the save records


def _run(
    cmd: list[str], *, expect_ok: bool = True, count: int = 1
) -> subprocess.CompletedProcess[str]:
    """``python CMD`` (``-m module ...``) as ``count`` ranks on one host (``zygote``:
    forked from a server that imported torch once); the ranks' stderr together."""
    ranks = run_workers(cmd, count, env=_env(), cwd=ROOT, timeout_s=TIMEOUT_S)
    code = next((c for c, _, _ in ranks if c != 0), 0)
    proc = subprocess.CompletedProcess(
        cmd, code, "".join(o for _, o, _ in ranks), "".join(e for _, _, e in ranks)
    )
    if expect_ok:
        assert proc.returncode == 0, f"{cmd[:2]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


@dataclass(frozen=True, slots=True)
class Saved:
    tmp: Path
    plans: Path  # directory of the plan files (versions of NAME)
    dirs: dict[str, Path]  # host -> its checkpoint dir
    remote: Path
    losses: dict[int, float]  # the saving run's
    reference: dict[int, float]  # the uninterrupted single-process run's


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    tmp = tmp_path_factory.mktemp("ckpt")
    plans = tmp / "plans"
    plans.mkdir()
    # The reference: one device, STEPS steps straight through.
    ref_plan = make_plan("reference", [(8, [(0, NUM_LAYERS)])], optimizer="adam")
    _, ref_path = write_plan(ref_plan, plans)
    _run(_args(ref_path, STEPS, "--metrics", str(tmp / "reference.jsonl")))
    # The saving run: 4 workers on hosts a (ranks 0-1) and b (ranks 2-3).
    _, path = write_plan(_two_host_plan(), plans)
    dirs = {h: tmp / f"disk-{h}" for h in "ab"}
    remote = tmp / "remote"
    _workers(
        path,
        4,
        "aabb",
        lambda host: [
            *("--run-dir", str(tmp / f"run-{host}"), "--checkpoint-every", "2"),
            *("--checkpoint-dir", str(dirs[host]), "--remote-storage", str(remote)),
        ],
    )
    return Saved(
        tmp=tmp,
        plans=plans,
        dirs=dirs,
        remote=remote,
        losses=_losses(tmp / "run-a" / "metrics.jsonl"),
        reference=_losses(tmp / "reference.jsonl"),
    )


def _workers(
    plan_path: Path,
    steps: int,
    hosts: str,
    extra: Callable[[str], list[str]],
    host_env: Callable[[str], dict[str, str]] = lambda _h: {},
) -> list[str]:
    """One worker per letter of ``hosts`` (its host; ranks in that order, each host's
    local ranks counting up), started as one torchrun agent per host would start them
    (``AUTOHET_HOST``, and ``host_env(host)``, as the launcher's per-host variables) with
    ``extra(host)`` as arguments (forked from a server that imported torch once:
    ``zygote``); their stderr, all succeeded."""
    rank_env = [
        {"LOCAL_RANK": str(hosts[:rank].count(host)), "AUTOHET_HOST": host, **host_env(host)}
        for rank, host in enumerate(hosts)
    ]
    rank_argv = [_args(plan_path, steps, *extra(host)) for host in hosts]
    ranks = run_workers(
        rank_argv[0], len(hosts), env=_env(), cwd=ROOT, timeout_s=TIMEOUT_S,
        rank_env=rank_env, rank_argv=rank_argv,
    )  # fmt: skip
    errors = []
    for code, _, stderr in ranks:
        assert code == 0, f"worker failed ({code}):\n{stderr[-4000:]}"
        errors.append(stderr)
    return errors


def _copy_root(saved: Saved, dest: Path, hosts: str = "ab") -> Path:
    """One checkpoint dir holding what ``hosts`` wrote: what recovery would assemble."""
    for host in hosts:
        shutil.copytree(saved.dirs[host], dest, dirs_exist_ok=True)
    return dest


def _assert_continues(saved: Saved, losses: dict[int, float], first: int) -> None:
    assert sorted(losses) == list(range(first, STEPS))
    for step, loss in losses.items():
        assert loss == pytest.approx(saved.reference[step], rel=1e-5), step


def _one_device(saved: Saved) -> Path:
    _, path = write_plan(make_plan(NAME, [(8, [(0, NUM_LAYERS)])], optimizer="adam"), saved.plans)
    return path


# --------------------------------------------------------------------- the saved layout


def test_each_host_holds_its_ranks_files_and_the_manifest_lists_them(saved: Saved) -> None:
    assert sorted(saved.losses) == [0, 1, 2, 3]
    for step, loss in saved.losses.items():
        assert loss == pytest.approx(saved.reference[step], rel=1e-5), step
    for step_dir in (STEP_2, STEP_4):
        a, b = (saved.dirs[h] / NS / step_dir for h in "ab")
        # Each rank's files (one per writer thread, __<rank>_<n>) on its own host.
        data = {
            h: sorted(n for n in os.listdir(d) if n.endswith(".distcp"))
            for h, d in zip("ab", (a, b), strict=True)
        }
        assert {n.split("_")[2] for n in data["a"]} == {"0", "1"}
        assert {n.split("_")[2] for n in data["b"]} == {"2", "3"}
        # and the files' recorded sha256 (ckpt.sums), which recover reads instead
        assert sorted(set(os.listdir(a)) - set(data["a"])) == [
            ".autohet-sums",
            ".metadata",
            "COMPLETE",
            "manifest.json",
        ]
        assert set(os.listdir(b)) == {*data["b"], ".autohet-sums"}
        manifest = load_manifest(a / "manifest.json")
        assert (manifest.step, manifest.plan, manifest.world_size) == (
            int(step_dir[5:]),
            f"{NAME}.v1",
            4,
        )
        assert {(f.path, f.host, f.rank) for f in manifest.files} == {(".metadata", "a", 0)} | {
            (n, h, int(n.split("_")[2])) for h in "ab" for n in data[h]
        }
        for f in manifest.files:
            local = saved.dirs[f.host] / NS / step_dir / f.path
            assert sha256_file(local) == f.sha256 and local.stat().st_size == f.num_bytes
            # The remote copy: every file, byte for byte, and COMPLETE.
            assert sha256_file(saved.remote / NS / step_dir / f.path) == f.sha256
        assert (saved.remote / NS / step_dir / "COMPLETE").is_file()
        assert load_manifest(saved.remote / NS / step_dir / "manifest.json") == manifest


# --------------------------------------------------------------------- what each file holds


def _dcp_contents(step_dir: Path) -> tuple[dict[str, set[int]], set[str]]:
    """Read from DCP's own ``.metadata``, not through the writer's code: data file ->
    the layers of the entries in it, and the files holding entries of no layer."""
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    layers: dict[str, set[int]] = {}
    shared: set[str] = set()
    for index, info in metadata.storage_data.items():
        held = layers.setdefault(info.relative_path, set())
        if m := re.search(r"(?:^|\.)layers\.(\d+)\.", index.fqn):
            held.add(int(m.group(1)))
        else:
            shared.add(info.relative_path)
    return layers, shared


def test_the_manifest_records_what_each_file_holds(saved: Saved) -> None:
    stage = {0: range(0, 2), 1: range(0, 4), 2: range(2, 6), 3: range(4, 6)}  # by rank
    head = NUM_LAYERS - 1
    for step_dir in (STEP_2, STEP_4):
        where = saved.dirs["a"] / NS / step_dir
        manifest = load_manifest(where / "manifest.json")
        held, shared = _dcp_contents(where)
        # step, loss_scale, run: rank 0's files alone (one per writer thread)
        assert shared and all(name.startswith("__0_") for name in shared)
        assert manifest.tied_layers == ((0, head),)  # the embedding and the LM head
        for f in manifest.files:
            if not f.is_data:
                assert (f.layers, f.shared) == (None, None)
                continue
            assert f.layers == tuple(sorted(held.get(f.path, ()))), (step_dir, f.path)
            assert f.shared == (f.path in shared), (step_dir, f.path)
            # DCP keeps a replicated entry in one of its holders' files; the tied
            # weight's optimizer state goes under layer 0's name from any holder.
            own = set(stage[f.rank])
            assert set(f.layers) <= own | ({0} if head in own else set()), (step_dir, f.path)
        assert set().union(*held.values()) == set(range(NUM_LAYERS))


def test_a_plan_given_only_the_files_the_layers_rule_selects_resumes_exactly(
    saved: Saved,
) -> None:
    """Hosts x [0,1), y [1,3), z [3,6): each host's directory keeps only the files
    ``needed_files(rule="layers")`` gives it, with no remote copy to fall back on. The
    run resumes and matches, loss for loss, the same plan resumed from every file."""
    plan = _on_hosts(make_plan(NAME, [(8, [(0, 1), (1, 3), (3, 6)])], optimizer="adam"), "xyz")
    _, path = write_plan(plan, saved.plans)
    manifest = load_manifest(saved.dirs["a"] / NS / STEP_4 / "manifest.json")
    every = {f.path for f in manifest.files}
    needs = {h: set(files) for h, files in needed_files(manifest, plan, rule="layers").items()}
    # y holds neither end of the tied pair, and rank 3 wrote layers 4-5 (+ 0) only.
    assert "__3_0.distcp" not in needs["y"] and needs["y"] < every
    losses = {}
    for rule, keep in (("all", dict.fromkeys("xyz", every)), ("layers", needs)):
        dirs = {h: _copy_root(saved, saved.tmp / f"rule-{rule}-{h}") for h in "xyz"}
        for h, root in dirs.items():
            shutil.rmtree(root / NS / STEP_2)
            for f in every - keep[h]:
                (root / NS / STEP_4 / f).unlink()
        metrics = saved.tmp / f"rule-{rule}.jsonl"
        errors = _workers(
            path,
            STEPS,
            "xyz",
            lambda h, d=dirs, m=metrics: [
                *("--resume", "--checkpoint-dir", str(d[h]), "--remote-storage", "none"),
                *("--metrics", str(m)),
            ],
        )
        assert f"resumed from {dirs['x'] / NS / STEP_4} at step 4" in errors[0]
        assert "fetched" not in "".join(errors)
        losses[rule] = _losses(metrics)
    assert losses["layers"] == losses["all"]
    _assert_continues(saved, losses["layers"], 4)


# --------------------------------------------------------------------- resuming


def _torchrun(
    plan: Plan, saved: Saved, steps: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``plan``'s ranks on one host, with torchrun's variables."""
    _, path = write_plan(plan, saved.plans)
    return _run(_args(path, steps, *extra), count=len(plan.devices()))


def _resumes_from_the_saved_run(saved: Saved, plan: Plan, tag: str) -> None:
    """``plan`` (named NAME) resumes the saving run's step 4 and continues its curve."""
    root = _copy_root(saved, saved.tmp / f"{tag}-disk")
    metrics = saved.tmp / f"{tag}.jsonl"
    proc = _torchrun(
        plan,
        saved,
        STEPS,
        *("--resume", "--checkpoint-dir", str(root)),
        *("--metrics", str(metrics), "--remote-storage", "none"),
    )
    assert f"resumed from {root / NS / STEP_4} at step 4" in proc.stderr
    _assert_continues(saved, _losses(metrics), 4)


def _one_device_resumes_what_it_saved(saved: Saved, plan: Plan, tag: str) -> None:
    """``plan`` trains 4 steps on the reference's curve, saving at steps 2 and 4;
    one device resumes its step 4 and continues the curve."""
    disk = saved.tmp / f"{tag}-disk"
    common = ("--checkpoint-dir", str(disk), "--remote-storage", "none")
    first = saved.tmp / f"{tag}-first.jsonl"
    _torchrun(plan, saved, 4, *("--checkpoint-every", "2", "--metrics", str(first), *common))
    for step, loss in _losses(first).items():
        assert loss == pytest.approx(saved.reference[step], rel=1e-5), step
    one = make_plan(plan.name, [(8, [(0, NUM_LAYERS)])], optimizer="adam")
    _, path = write_plan(one, saved.plans)
    metrics = saved.tmp / f"{tag}.jsonl"
    proc = _run(_args(path, STEPS, "--resume", *common, "--metrics", str(metrics)))
    assert f"resumed from {disk / plan.name / 'default' / STEP_4} at step 4" in proc.stderr
    _assert_continues(saved, _losses(metrics), 4)


def test_resume_under_one_pipeline_with_tp2_continues_the_loss_curve(saved: Saved) -> None:
    """Other cut ([0,3) + [3,6)), TP 2, one pipeline instead of two; AdamW state resharded."""
    plan = make_plan(NAME, [(8, [(0, 3), (3, 6)])], tp=2, optimizer="adam")
    _resumes_from_the_saved_run(saved, plan, "tp2")


# TP per stage: [0,3) at TP 2 -> [3,6) at TP 1, beside [0,2) TP 1 -> [2,4) TP 2 -> [4,6)
# TP 1. Layers [0,2), [3,4) and the tied embedding/head are held at two degrees.
MIXED_TP = [(3, [(0, 3, 2), (3, 6, 1)]), (5, [(0, 2, 1), (2, 4, 2), (4, 6, 1)])]


def test_resume_under_a_mixed_tp_plan_continues_the_loss_curve(saved: Saved) -> None:
    """Loading reshards the saved TP-1 layout into stages of TP 1 and TP 2."""
    _resumes_from_the_saved_run(saved, make_plan(NAME, MIXED_TP, optimizer="adam"), "mixed-in")


def test_a_mixed_tp_plan_saves_what_one_device_resumes_exactly(saved: Saved) -> None:
    """A name held at two TP degrees is saved in one layout (``writes_layout``), so
    the checkpoint is valid and a one-device plan continues the loss curve."""
    plan = make_plan("ckpt-mixed", MIXED_TP, optimizer="adam")
    _one_device_resumes_what_it_saved(saved, plan, "mixed-out")


ZERO_LAYOUT = [(3, [(0, 2), (2, 6)]), (5, [(0, 4), (4, 6)])]


def test_resume_under_zero1_continues_the_loss_curve(saved: Saved) -> None:
    """A checkpoint of replicated optimizer state loads into ZeRO-1 slices."""
    plan = make_plan(NAME, ZERO_LAYOUT, optimizer="adam", zero1=True)
    _resumes_from_the_saved_run(saved, plan, "zero-in")


def test_resume_under_zero1_with_tp2_continues_the_loss_curve(saved: Saved) -> None:
    """ZeRO-1 slices of TP-sharded parameters (DTensors) cut from a load that reads
    every parameter's full state on each member, with no collective."""
    plan = make_plan(NAME, [(4, [(0, NUM_LAYERS)])] * 2, tp=2, optimizer="adam", zero1=True)
    _resumes_from_the_saved_run(saved, plan, "zero-tp")


def test_zero1_saves_what_one_device_resumes_exactly(saved: Saved) -> None:
    """ZeRO-1 slices are written per parameter, in full, by one member each."""
    plan = make_plan("ckpt-zero", ZERO_LAYOUT, optimizer="adam", zero1=True)
    _one_device_resumes_what_it_saved(saved, plan, "zero-out")


def test_incomplete_checkpoint_is_refused_and_resume_falls_back(saved: Saved) -> None:
    root = _copy_root(saved, saved.tmp / "incomplete-disk")
    (root / NS / STEP_4 / "COMPLETE").unlink()
    path = _one_device(saved)
    common = ("--checkpoint-dir", str(root), "--remote-storage", "none")
    proc = _run(_args(path, STEPS, "--resume", "4", *common), expect_ok=False)
    assert proc.returncode == 1
    assert f"checkpoint {root / NS / STEP_4} is not usable (no COMPLETE marker" in proc.stderr
    metrics = saved.tmp / "fallback.jsonl"
    proc = _run(_args(path, STEPS, "--resume", *common, "--metrics", str(metrics)))
    assert f"skipping checkpoint {root / NS / STEP_4}" in proc.stderr
    assert f"resumed from {root / NS / STEP_2} at step 2" in proc.stderr
    _assert_continues(saved, _losses(metrics), 2)


def test_corrupted_file_is_detected_by_its_sha256(saved: Saved) -> None:
    root = _copy_root(saved, saved.tmp / "corrupt-disk")
    victim = root / NS / STEP_4 / "__2_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    common = ("--checkpoint-dir", str(root), "--remote-storage", "none")
    proc = _run(_args(_one_device(saved), STEPS, "--resume", *common), expect_ok=False)
    assert proc.returncode == 1
    assert f"{victim} is corrupt: its sha256 is" in proc.stderr


def test_missing_file_is_named_or_fetched_from_the_remote_copy(saved: Saved) -> None:
    """Host b's files never copied over: an error naming them, or the remote copy fills in."""
    root = _copy_root(saved, saved.tmp / "a-only-disk", hosts="a")
    path = _one_device(saved)
    proc = _run(
        _args(path, STEPS, "--resume", "--checkpoint-dir", str(root), "--remote-storage", "none"),
        expect_ok=False,
    )
    assert proc.returncode == 1
    missing = root / NS / STEP_4 / "__2_0.distcp"
    assert f"{missing} is missing: rank 0 reads it, and host b wrote it" in proc.stderr
    metrics = saved.tmp / "fetched.jsonl"
    proc = _run(
        _args(path, STEPS, "--resume", "--checkpoint-dir", str(root), "--metrics", str(metrics))
        + ["--remote-storage", f"file://{saved.remote}"]
    )
    assert "fetched __2_0.distcp" in proc.stderr and "fetched __3_0.distcp" in proc.stderr
    assert sha256_file(missing) == sha256_file(saved.dirs["b"] / NS / STEP_4 / "__2_0.distcp")
    _assert_continues(saved, _losses(metrics), 4)
