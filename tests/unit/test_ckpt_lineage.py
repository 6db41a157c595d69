"""A checkpoint says what it is: the architecture its weights were trained as and
where its data stand; a resume trains that model on the next unseen samples, or
refuses with both sides named (issue 45, items 1 and 2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from autohet_cli.ckpt.checkpointer import Checkpointer
from autohet_cli.ckpt.format import Manifest, ManifestFile, manifest_from_json, manifest_to_dict
from autohet_cli.ckpt.lineage import (
    DataOrder,
    batch_change_refusal,
    data_shift,
    model_differences,
    model_record,
)
from autohet_cli.errors import ConfigError
from autohet_cli.models import get_model
from autohet_cli.plan import Plan
from autohet_cli.recovery.manifest import load_manifest
from autohet_cli.runtime import run_state
from autohet_cli.runtime.trainer import TrainConfig, Trainer
from tests.planting import plan_of, stage

GPT_TINY = get_model("gpt-tiny")


def _plan(batch: int = 4, architecture: object = None) -> Plan:
    return plan_of(
        [stage(0, 6, "h0")],
        microbatches=batch // 2,
        micro_batch_size=2,
        seq_len=16,
        precision="fp32",
        name="one",
        version=3,
        architecture=architecture,
    )


# --------------------------------------------------------------------- pure


def test_the_same_shapes_with_other_heads_and_rope_are_another_model() -> None:
    """The issue's case: hidden 128 in both, 4 heads / 2 KV heads / rope 1e4 then,
    8 / 4 / 5e5 now: every weight has the same shape, the model is not the same."""
    then = get_model("llama-tiny")
    now = dataclasses.replace(then, num_heads=8, num_kv_heads=4, rope_theta=500000.0)
    assert (then.hidden_size, now.hidden_size) == (128, 128)
    differ = model_differences(model_record(then), model_record(now))
    assert differ == [
        "num_heads 4 then, 8 now",
        "num_kv_heads 2 then, 4 now",
        "rope_theta 10000.0 then, 500000.0 now",
    ]
    # A display name or the planner's default length changes nothing the weights mean.
    renamed = dataclasses.replace(then, name="my-llama", default_seq_len=64)
    assert model_differences(model_record(then), model_record(renamed)) == []


def _manifest(**fields: Any) -> Manifest:
    """Step 8 of plan one.v3 on one rank, one file; ``fields``: the manifest's others."""
    files = (ManifestFile(path=".metadata", sha256="b" * 64, num_bytes=3, host="h", rank=0),)
    return Manifest(
        step=8, plan="one.v3", plan_sha256="a" * 64, world_size=1, files=files, **fields
    )


def test_the_manifest_carries_model_and_data_order_and_refuses_edits() -> None:
    order = DataOrder(global_batch_size=8, samples_seen=64, seed=7, data_sha256="c" * 64)
    m = _manifest(model=model_record(GPT_TINY), data_order=order)
    d = manifest_to_dict(m)
    back = manifest_from_json(json.dumps(d), "m.json")
    assert back.model == m.model and back.data_order == m.data_order
    d["model"]["fields"]["num_heads"] = 8  # edited without the hash
    with pytest.raises(ConfigError, match=r"m.json: model.sha256: does not match"):
        manifest_from_json(json.dumps(d), "m.json")
    d = manifest_to_dict(m)
    d["data_order"]["extra"] = 1
    with pytest.raises(ConfigError, match="extra"):
        manifest_from_json(json.dumps(d), "m.json")


def test_the_data_shift_continues_at_the_next_sample_or_is_refused() -> None:
    # Saved at step 8 of batch 8 (64 samples): batch 16 reads data step 4 at step 8.
    assert data_shift(samples_seen=64, step=8, global_batch_size=16) == -4
    assert data_shift(samples_seen=64, step=8, global_batch_size=4) == 8
    assert data_shift(samples_seen=64, step=8, global_batch_size=8) == 0
    assert data_shift(samples_seen=72, step=9, global_batch_size=16) is None
    why = batch_change_refusal(where="step 9", samples_seen=72, step=9, saved_batch=8, batch=16)
    assert "72 samples (step 9 at a global batch of 8)" in why
    assert "global batch of 16 does not divide 72" in why and "e.g. 18" in why


# --------------------------------------------------------------------- in one process


def _tokens(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp / "tokens.npy"
    np.save(path, rng.integers(0, 256, size=20_000, dtype=np.uint16))
    return path


def _trainer(plan: Plan, data: Path | None) -> Trainer:
    if dist.is_initialized():
        dist.destroy_process_group()
    config = TrainConfig(seed=3, device="cpu", data=None if data is None else str(data))
    return Trainer(plan, config)


def _ckpt(trainer: Trainer, tmp: Path) -> Checkpointer:
    return Checkpointer(
        trainer, root=tmp / "ckpt", plan_ref="one.v3", plan_sha256="a" * 64, job="j1"
    )


@pytest.mark.usefixtures("alone")
def test_resume_refuses_another_architecture_of_the_same_shapes(tmp_path: Path) -> None:
    trainer = _trainer(_plan(), None)
    trainer.fit(2)
    ckpt = _ckpt(trainer, tmp_path)
    step_dir = ckpt.save()
    ckpt.close()
    manifest = load_manifest(step_dir / "manifest.json")
    assert manifest.model == model_record(GPT_TINY)
    assert manifest.data_order is not None and manifest.data_order.samples_seen == 8
    # 8 heads of 8 instead of 4 of 16: every tensor keeps its shape.
    other = dataclasses.replace(GPT_TINY, num_heads=8, num_kv_heads=8)
    resumed = _trainer(_plan(architecture=other), None)
    before = {k: v.clone() for k, v in resumed.stage.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        _ckpt(resumed, tmp_path).resume()
    text = str(err.value)
    assert str(step_dir) in text and "another model than this plan's" in text
    assert "num_heads 4 then, 8 now" in text and "num_kv_heads 4 then, 8 now" in text
    assert "which no --init-from makes either" in text  # heads are not a context change
    assert resumed.step == 0  # nothing loaded
    for k, v in resumed.stage.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.usefixtures("alone")
def test_resume_under_another_batch_continues_at_the_next_unseen_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _tokens(tmp_path)
    trainer = _trainer(_plan(batch=4), data)
    trainer.fit(2)  # samples 0..7 of the shuffled stream
    ckpt = _ckpt(trainer, tmp_path)
    ckpt.save()
    ckpt.close()

    # Batch 8: step 2 must train samples 8..15, what batch 4's steps 2 and 3 would have.
    resumed = _trainer(_plan(batch=8), data)
    ckpt = _ckpt(resumed, tmp_path)
    assert ckpt.resume() == 2 and resumed.data_shift == -1
    assert "global batch changed from 4 to 8: step 2 starts at sample 8" in capsys.readouterr().err
    dataset = resumed.data
    got = np.concatenate(
        [dataset.train_sample_indices(s, 4) for s in (2, 3)]  # type: ignore[attr-defined]
    )
    rows = torch.cat([x for x, _ in resumed._microbatches(resumed.step)])
    want = dataset.global_batch(1, 8)[0]  # type: ignore[attr-defined]
    assert torch.equal(rows, want)
    assert np.array_equal(dataset.train_sample_indices(1, 8), got)  # type: ignore[attr-defined]
    resumed.fit(1)
    step_dir = ckpt.save()
    ckpt.close()
    order = load_manifest(step_dir / "manifest.json").data_order
    assert order is not None and (order.global_batch_size, order.samples_seen) == (8, 16)

    # Batch 6 does not divide the 8 samples of step 2: refused, both batches named.
    again = _trainer(_plan(batch=6), data)
    with pytest.raises(ConfigError) as err:
        _ckpt(again, tmp_path).resume(2)
    assert "global batch of 6 does not divide 8" in str(err.value)
    assert "(step 2 at a global batch of 4)" in str(err.value)


@pytest.mark.usefixtures("alone")
def test_synthetic_data_refuse_another_batch(tmp_path: Path) -> None:
    """Synthetic batches are drawn per step, not placed by sample: no next sample."""
    trainer = _trainer(_plan(batch=4), None)
    trainer.fit(2)
    ckpt = _ckpt(trainer, tmp_path)
    ckpt.save()
    ckpt.close()
    resumed = _trainer(_plan(batch=8), None)
    with pytest.raises(ConfigError, match="not placed by sample.*global_batch_size 4"):
        _ckpt(resumed, tmp_path).resume()


def test_recover_refuses_a_plan_of_another_model_than_the_checkpoint() -> None:
    from autohet_cli.recovery.choose import _check_model
    from autohet_cli.recovery.errors import RecoveryError
    from autohet_cli.recovery.manifest import CheckpointChoice

    def choice(model: object) -> CheckpointChoice:
        manifest = _manifest(model=model)
        return CheckpointChoice(
            step_dir="step-00000008", manifest=manifest, holders={}, remote_only=()
        )

    _check_model(_plan(), choice(model_record(GPT_TINY)))  # the same: no word
    _check_model(_plan(), choice(None))  # not recorded (older writer): as before
    other = dataclasses.replace(GPT_TINY, num_heads=8, num_kv_heads=8)
    with pytest.raises(RecoveryError, match=r"step-00000008 holds .* num_heads 4 then, 8 now"):
        _check_model(_plan(architecture=other), choice(model_record(GPT_TINY)))


@pytest.mark.usefixtures("alone")
def test_export_compares_the_recorded_model_not_the_plan_bytes(tmp_path: Path) -> None:
    """Any plan of the checkpoint's model exports it (a recovered v2 has other bytes);
    a plan of another model with the same shapes is refused, both sides named."""
    from autohet_cli.plan import write_plan
    from autohet_cli.runtime.hf_export import ExportError, open_checkpoint, spec_for

    trainer = _trainer(_plan(), None)
    trainer.fit(1)
    ckpt = _ckpt(trainer, tmp_path)
    step_dir = ckpt.save()
    ckpt.close()
    opened = open_checkpoint(step_dir)
    _, same = write_plan(dataclasses.replace(_plan(), notes=("recovered",)), tmp_path / "p")
    assert spec_for(opened, same) == GPT_TINY  # its sha256 is not the manifest's: fine
    other = dataclasses.replace(GPT_TINY, num_heads=8, num_kv_heads=8)
    _, wrong = write_plan(_plan(architecture=other), tmp_path / "q")
    with pytest.raises(ExportError, match=r"another model than .* num_heads 4 then, 8 now"):
        spec_for(opened, wrong)


def test_a_rope_change_at_resume_is_refused_and_points_to_init_from() -> None:
    """Another rope is a deliberate change of model: not a resume (the run trained the
    old one), but what ``--init-from`` makes (and says), so the refusal names it."""
    then = get_model("llama-tiny")
    now = dataclasses.replace(then, rope_theta=500000.0)
    trainer = SimpleNamespace(plan=SimpleNamespace(architecture=now, name="one"))
    with pytest.raises(ConfigError) as err:
        run_state.check_same_model(trainer, model_record(then), "ckpt/step-6")  # type: ignore[arg-type]
    text = str(err.value)
    assert "rope_theta 10000.0 then, 500000.0 now" in text
    assert "launch a new job with --init-from (weights only)" in text


@pytest.mark.usefixtures("alone")
@pytest.mark.parametrize("batch", [16, 4])
def test_a_batch_8_checkpoint_resumed_at_another_batch_trains_the_next_rows(
    tmp_path: Path, batch: int
) -> None:
    """The issue's case: saved at batch 8, resumed at 16 (rows skipped before) or 4
    (rows repeated before). The resumed step trains exactly the samples the batch-8 run
    would have trained next, and the next checkpoint records where that leaves it."""
    data = _tokens(tmp_path)
    trainer = _trainer(_plan(batch=8), data)
    trainer.fit(2)  # samples 0..15
    ckpt = _ckpt(trainer, tmp_path)
    ckpt.save()
    ckpt.close()
    stream = trainer.data
    # What batch 8 would train next: samples 16.., as rows of data.
    nxt = np.concatenate([stream.train_sample_indices(s, 8) for s in (2, 3)])[:batch]  # type: ignore[attr-defined]

    resumed = _trainer(_plan(batch=batch), data)
    ckpt = _ckpt(resumed, tmp_path)
    assert ckpt.resume() == 2
    dataset = resumed.data
    trained = dataset.train_sample_indices(resumed.step + resumed.data_shift, batch)  # type: ignore[attr-defined]
    assert np.array_equal(trained, nxt)
    rows = torch.cat([x for x, _ in resumed._microbatches(resumed.step)])
    windows = dataset._windows(nxt)[0]  # type: ignore[attr-defined]
    assert torch.equal(rows, windows)
    resumed.fit(1)
    step_dir = ckpt.save()
    ckpt.close()
    order = load_manifest(step_dir / "manifest.json").data_order
    assert order is not None and (order.global_batch_size, order.samples_seen) == (
        batch,
        16 + batch,
    )
