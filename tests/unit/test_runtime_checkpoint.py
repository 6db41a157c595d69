"""Checkpoints in one process: round trip, manifest, markers, remote copy, refusals."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autohet_cli.ckpt.checkpointer import (
    Checkpointer,
    CheckpointError,
    RemoteCopy,
    Uploader,
    checkpoint_root,
    incomplete_reason,
    list_steps,
    remote_url,
    rename_optimizer,
    sha256_file,
    tied_aliases,
)
from autohet_cli.ckpt.remote import UploadJob
from autohet_cli.ckpt.state import nested_optimizer
from autohet_cli.recovery.manifest import Manifest, ManifestFile, load_manifest
from autohet_cli.runtime.trainer import TrainConfig, Trainer
from tests.planting import plan_of, plant_step, stage

PLAN = plan_of(
    [stage(0, 6, "h0")], name="one", version=3, precision="fp32", micro_batch_size=2, seq_len=16
)
CONFIG = TrainConfig(seed=3, device="cpu")
SHA = "0" * 64


pytestmark = pytest.mark.usefixtures("alone")


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.stage.state_dict().items()}


def _checkpointer(trainer: Trainer, root: Path, remote: Path | None = None) -> Checkpointer:
    return Checkpointer(
        trainer,
        root=root,
        plan_ref="one.v3",
        plan_sha256="a" * 64,
        job="j1",
        remote=RemoteCopy(str(remote), "one", "j1") if remote else None,
    )


def _fresh(tmp: Path, steps: int) -> tuple[Trainer, Checkpointer]:
    if dist.is_initialized():
        dist.destroy_process_group()
    trainer = Trainer(PLAN, CONFIG)
    trainer.fit(steps)
    return trainer, _checkpointer(trainer, tmp / "ckpt", tmp / "remote")


# --------------------------------------------------------------------- round trip


def test_save_then_resume_continues_bitwise(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 2)
    step_dir = ckpt.save()
    ckpt.close()
    trainer.fit(1)
    want = _params(trainer)

    assert step_dir == tmp_path / "ckpt" / "one" / "j1" / "step-00000002"
    manifest = load_manifest(step_dir / "manifest.json")  # the recovery side's parser
    assert (manifest.step, manifest.plan, manifest.world_size) == (2, "one.v3", 1)
    # One rank, one data file per writer thread (the host's cores): every layer and the
    # shared entries between them, each file's sha256 taken on its way out.
    data = [f for f in manifest.files if f.path != ".metadata"]
    assert ".metadata" in {f.path for f in manifest.files}
    assert sorted(f.path for f in data) == [f"__0_{i}.distcp" for i in range(ckpt.writer_threads)]
    assert sorted({n for f in data for n in f.layers}) == list(range(6))
    assert any(f.shared for f in data) and manifest.tied_layers == ((0, 5),)
    for f in manifest.files:
        assert (f.host, f.rank) == ("h0", 0)
        assert sha256_file(step_dir / f.path) == f.sha256
        assert sha256_file(tmp_path / "remote" / "one" / "j1" / "step-00000002" / f.path) == (
            f.sha256
        )
    assert (tmp_path / "remote" / "one" / "j1" / "step-00000002" / "COMPLETE").is_file()
    assert list_steps(tmp_path / "ckpt" / "one" / "j1", ckpt.key) == {2: None}
    assert list_steps(tmp_path / "ckpt" / "one" / "j1", b"k" * 32) == {
        2: "manifest.json does not authenticate with this job's key (planted or altered?)"
    }

    resumed, ckpt = _fresh(tmp_path, 0)
    assert ckpt.resume() == 2 and resumed.step == 2
    resumed.fit(1)
    got = _params(resumed)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_the_layer_record_comes_from_the_written_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: under torch 2.11 ``dcp.save`` returns a Metadata without storage_data
    (its writer fills a replaced copy); the manifest must come from what was written."""
    from autohet_cli.ckpt import finish as checkpoint

    real = checkpoint.dcp_save

    def like_211(*args: Any, **kw: Any) -> Any:
        return dataclasses.replace(real(*args, **kw), storage_data=None)

    monkeypatch.setattr(checkpoint, "dcp_save", like_211)
    _, ckpt = _fresh(tmp_path, 1)
    step_dir = ckpt.save()
    ckpt.close()
    assert step_dir is not None
    data = [f for f in load_manifest(step_dir / "manifest.json").files if f.is_data]
    assert sorted({n for f in data for n in f.layers or ()}) == list(range(6))
    assert any(f.shared for f in data)


def test_resume_without_checkpoints_starts_afresh(tmp_path: Path) -> None:
    trainer, ckpt = _fresh(tmp_path, 0)
    assert ckpt.resume() is None and trainer.step == 0


def test_refusals_name_the_directory_or_file(tmp_path: Path) -> None:
    _, ckpt = _fresh(tmp_path, 1)
    step_dir = ckpt.save()
    ckpt.close()
    with pytest.raises(CheckpointError, match="no checkpoint .*step-00000005 on any host"):
        ckpt.resume(5)
    (step_dir / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {step_dir} is not usable"):
        ckpt.resume(1)
    (step_dir / "COMPLETE").touch()
    meta = step_dir / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"x")
    with pytest.raises(CheckpointError, match=f"{meta} is corrupt"):
        ckpt.resume(1)


def test_a_complete_step_is_never_overwritten_and_leftovers_are_cleared(tmp_path: Path) -> None:
    """Item 3 of issue 11: a save never deletes a COMPLETE step; half-written ones go."""
    trainer, ckpt = _fresh(tmp_path, 1)
    job = tmp_path / "ckpt" / "one" / "j1"
    done = ckpt.save()
    ckpt.wait()  # durable (the files were written in the background)
    assert done is not None
    before = {p.name: p.read_bytes() for p in done.iterdir()}
    assert ckpt.save() is None  # the same step again: kept as it was
    assert {p.name: p.read_bytes() for p in done.iterdir()} == before
    trainer.fit(1)
    half = job / "step-00000002"
    half.mkdir()
    (half / "__7_0.distcp").write_bytes(b"old")  # no COMPLETE: an interrupted attempt
    (job / ".tmp-step-00000002").mkdir()
    saved = ckpt.save()
    ckpt.close()
    assert saved == half and not (half / "__7_0.distcp").exists()
    assert not (job / ".tmp-step-00000002").exists()
    assert incomplete_reason(half, ckpt.key) is None


def test_a_planted_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    """Item 1 of issue 11: a newer step whose manifest's sha256 fit a malicious .metadata."""
    trainer, ckpt = _fresh(tmp_path, 1)
    good = ckpt.save()
    ckpt.close()
    assert good is not None
    marker = tmp_path / "pwned"
    plant_step(good, 99, marker)
    resumed, ckpt = _fresh(tmp_path, 0)
    assert ckpt.resume() == 1  # step 99 is skipped: it does not authenticate
    with pytest.raises(CheckpointError, match="does not authenticate"):
        ckpt.resume(99)
    assert not marker.exists()


def test_directories_others_can_write_are_refused(tmp_path: Path) -> None:
    """Item 1: like ssh's StrictModes, a checkpoint dir writable by others is refused."""
    if dist.is_initialized():
        dist.destroy_process_group()
    trainer = Trainer(PLAN, CONFIG)
    shared = tmp_path / "shared"
    (shared / "one" / "j1").mkdir(parents=True)
    (shared / "one").chmod(0o777)
    with pytest.raises(CheckpointError, match="writable by others"):
        _checkpointer(trainer, shared)
    private = tmp_path / "private"
    ckpt = _checkpointer(trainer, private)
    assert (private / "one" / "j1").stat().st_mode & 0o777 == 0o700
    key = private / "one" / "j1" / ".autohet-key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
    assert ckpt.key == key.read_bytes()
    key.chmod(0o644)
    with pytest.raises(CheckpointError, match="readable or writable by others"):
        _checkpointer(trainer, private)


# --------------------------------------------------------------------- helpers


def test_tied_optimizer_state_is_filed_under_the_groups_first_name() -> None:
    tied = [("layers.0.wte.weight", "layers.5.lm_head.weight")]
    head_only = {
        "state.layers.5.lm_head.weight.exp_avg": 1,
        "param_groups.layers.5.lm_head.weight.lr": 2,
        "state.layers.5.ln_f.weight.exp_avg": 3,
    }
    aliases = tied_aliases(list(head_only), tied)
    assert aliases == {"layers.5.lm_head.weight": "layers.0.wte.weight"}
    renamed = rename_optimizer(head_only, aliases)
    assert renamed == {
        "state.layers.0.wte.weight.exp_avg": 1,
        "param_groups.layers.0.wte.weight.lr": 2,
        "state.layers.5.ln_f.weight.exp_avg": 3,
    }
    back = rename_optimizer(renamed, {v: k for k, v in aliases.items()})
    assert back == head_only
    assert tied_aliases(["state.layers.0.wte.weight.step"], tied) == {}


def test_a_tied_parameters_flat_optimizer_state_loads_under_one_name() -> None:
    """Issue 27: torch 2.5's reader of the flat form wanted state under every name of a
    tied parameter; checkpoints hold one, so the trainer hands torch the nested form."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def tied_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"wte": torch.nn.Linear(3, 3), "head": torch.nn.Linear(3, 3)})
        model["head"].weight = model["wte"].weight
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = tied_model()
    sum(m(torch.ones(2, 3)).sum() for m in model.values()).backward()
    opt.step()
    flat = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert not any(k.startswith("state.head.weight.") for k in flat)  # one name per tensor
    nested = nested_optimizer(flat)
    assert nested["state"]["wte.weight"]["exp_avg"] is flat["state.wte.weight.exp_avg"]
    assert {"params": ["head.bias"], **{"lr": 0.1}}.items() <= nested["param_groups"][-1].items()
    fresh, fresh_opt = tied_model()
    set_optimizer_state_dict(fresh, fresh_opt, nested)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    with pytest.raises(ValueError, match="not a flattened optimizer entry: 'step'"):
        nested_optimizer({"step": 1})


def test_step_directories_and_their_markers(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    for step, files in [(4, ["manifest.json"]), (6, [])]:
        d = plan_dir / f"step-{step:08d}"
        d.mkdir(parents=True)
        for f in files:
            (d / f).touch()
    (plan_dir / "notes").mkdir()
    steps = list_steps(plan_dir, b"k" * 32)
    assert "no COMPLETE marker" in (steps[4] or "") and "no COMPLETE marker" in (steps[6] or "")
    assert sorted(steps) == [4, 6]
    assert list_steps(tmp_path / "nowhere", None) == {}


def test_where_checkpoints_go(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("AUTOHET_CHECKPOINT_DIR", "AUTOHET_REMOTE_STORAGE", "AUTOHET_REMOTE"):
        monkeypatch.delenv(env, raising=False)
    run = Path("/w/runs/p.v1/20250101")
    assert checkpoint_root(None, run) == Path("/w/runs/checkpoints")
    assert checkpoint_root(None, None) is None
    monkeypatch.setenv("AUTOHET_CHECKPOINT_DIR", "/env/ckpt")
    assert checkpoint_root(None, run) == Path("/env/ckpt")
    assert checkpoint_root(Path("/flag"), run) == Path("/flag")
    assert remote_url(None) is None  # no remote copy unless one is configured
    monkeypatch.setenv("AUTOHET_REMOTE_STORAGE", "memory://new")
    assert remote_url(None) == "memory://new"
    assert remote_url("none") is None and remote_url("file:///x") == "file:///x"


def test_rank0_uploads_complete_only_after_every_file_arrived(tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    for name, data in [("__0_0.distcp", b"zero"), (".metadata", b"meta"), ("manifest.json", b"{}")]:
        (local / name).write_bytes(data)
    (local / "__1_0.distcp").write_bytes(b"one!")
    files = tuple(
        ManifestFile(path=n, sha256=SHA, num_bytes=4, host="h", rank=r)
        for n, r in [("__0_0.distcp", 0), (".metadata", 0), ("__1_0.distcp", 1)]
    )
    manifest = Manifest(step=8, plan="p.v1", plan_sha256=SHA, world_size=2, files=files)
    remote = RemoteCopy(f"file://{tmp_path / 'remote'}", "p", "j")
    rank0 = Uploader(remote, timeout_s=30)
    rank0.start(
        UploadJob(step=8, local_dir=local, names=("__0_0.distcp", ".metadata"), manifest=manifest)
    )
    time.sleep(0.5)
    target = tmp_path / "remote" / "p" / "j" / "step-00000008"
    assert (target / "manifest.json").is_file() and not (target / "COMPLETE").exists()
    rank1 = Uploader(remote)
    threading.Timer(
        0.2, rank1.start, [UploadJob(step=8, local_dir=local, names=("__1_0.distcp",))]
    ).start()
    rank0.join()
    rank1.join()
    assert (target / "COMPLETE").is_file() and (target / "__1_0.distcp").read_bytes() == b"one!"
    assert not rank0.errors and not rank1.errors


def test_an_upload_that_never_completes_warns_and_leaves_no_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "manifest.json").write_bytes(b"{}")
    lost = ManifestFile(path="__1_0.distcp", sha256=SHA, num_bytes=4, host="h", rank=1)
    manifest = Manifest(step=1, plan="p.v1", plan_sha256=SHA, world_size=2, files=(lost,))
    uploader = Uploader(RemoteCopy(str(tmp_path / "remote"), "p", "j"), timeout_s=0.5)
    uploader.start(UploadJob(step=1, local_dir=local, names=(), manifest=manifest))
    uploader.join()
    assert uploader.errors and "__1_0.distcp did not reach" in uploader.errors[0]
    assert "warning: upload of" in capsys.readouterr().err
    assert not (tmp_path / "remote" / "p" / "j" / "step-00000001" / "COMPLETE").exists()


def test_a_checkpoint_from_before_the_run_entry_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before they held the schedule and data fingerprint load."""
    original = Trainer.state_dict

    def without_run(self: Trainer, **kw: Any) -> dict[str, Any]:
        state = original(self, **kw)
        state.pop("run")
        return state

    trainer, ckpt = _fresh(tmp_path, 2)
    monkeypatch.setattr(Trainer, "state_dict", without_run)
    ckpt.save()
    ckpt.close()
    monkeypatch.setattr(Trainer, "state_dict", original)
    resumed, ckpt = _fresh(tmp_path, 0)
    assert ckpt.resume() == 2 and resumed.step == 2
