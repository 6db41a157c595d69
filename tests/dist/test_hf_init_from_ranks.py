"""``--init-from`` across two pipeline stages: one report, one verdict for every rank.

Each rank reads only its own layers, yet every rank checks the whole model against
the checkpoint's headers, so a tensor missing from (or extra to, or of another
shape in) the other stage's layers stops both ranks with the same message; a
problem only one stage can see (NaN in its tensor) is shared before training, so
the other rank stops too instead of waiting at its first send. Rank 0 alone
prints what was loaded, stage by stage. Workers start as torchrun starts them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.plan import write_plan
from tests.dist.test_families_exact import make_plan
from tests.dist.test_runtime_exact import ROOT, _env, _free_port
from tests.hf_reference import random_model

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA (embedding, 2 blocks, norm, head) saved in bfloat16."""
    d = tmp_path_factory.mktemp("llama")
    random_model("llama").to(torch.bfloat16).save_pretrained(d)
    return d


def launch(weights: Path, tmp: Path) -> list[tuple[int, str, dict[str, Any] | None]]:
    """Two workers, stages [0, 2) and [2, 5), one step: (exit code, stderr, error record)."""
    spec = load_hf_config(str(weights / "config.json"))
    _, plan = write_plan(make_plan("hf", spec, [(2, [(0, 2), (2, spec.num_layers)])]), tmp)
    run_dir = tmp / "run"
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = _env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        cmd = [
            *(sys.executable, "-m", "autohet_cli.runtime.train", "--plan", str(plan)),
            *("--steps", "1", "--init-from", str(weights), "--device", "cpu"),
            *("--run-dir", str(run_dir), "--checkpoint-every", "0", "--no-emergency-save"),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        )  # fmt: skip
    out = []
    try:
        for rank, p in enumerate(procs):
            _, stderr = p.communicate(timeout=TIMEOUT_S)
            record = run_dir / "errors" / f"rank{rank}.json"
            out.append(
                (p.returncode, stderr, json.loads(record.read_text()) if record.exists() else None)
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def edited(weights: Path, dest: Path, edit: Any, *, config: Path | None = None) -> Path:
    state = load_file(str(weights / "model.safetensors"))
    edit(state)
    dest.mkdir()
    (dest / "config.json").write_text((config or weights / "config.json").read_text())
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.timeout(200)
def test_rank_0_says_what_each_stage_loaded(weights: Path, tmp_path: Path) -> None:
    (code0, err0, _), (code1, err1, _) = launch(weights, tmp_path)
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    assert "--init-from" not in err1
    assert f"--init-from {weights}: 21 tensors, " in err0
    assert "of bfloat16 in 1 file: model.safetensors; every tensor of the model (21)" in err0
    # embedding and block 0's 9 tensors; block 1, the final norm and the head
    assert "loaded bfloat16 as float32" in err0
    assert "layers 0-1: 10 tensors (" in err0 and "layers 2-4: 11 tensors (" in err0


def refused(weights: Path, tmp: Path) -> str:
    """Both ranks exit 1 with one message, recorded for the launcher's root cause."""
    results = launch(weights, tmp)
    messages = []
    for code, stderr, record in results:
        assert code == 1, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        assert record is not None and record["kind"] == "error", stderr[-3000:]
        messages.append(record["message"])
    assert messages[0] == messages[1], messages
    return str(messages[0])


@pytest.mark.timeout(200)
def test_unused_missing_and_reshaped_tensors_of_stage_1_stop_both_ranks(
    weights: Path, tmp_path: Path
) -> None:
    """Stage 0 reads none of them, and names them all. (Weights of another hidden size
    beside the original config.json: tests/unit/test_hf_init_from.py.)"""

    def edit(state: dict[str, torch.Tensor]) -> None:
        state.pop("model.layers.1.mlp.down_proj.weight")
        state["model.layers.1.mlp.router.weight"] = torch.ones(4, 64)
        state["model.layers.1.mlp.up_proj.weight"] = torch.ones(96, 32)

    message = refused(edited(weights, tmp_path / "d", edit), tmp_path)
    assert "config.json describes (2 blocks, hidden size 64): " in message, message
    shape = "1 tensor of another shape: model.layers.1.mlp.up_proj.weight [96, 32], model [96, 64]"
    assert shape in message, message
    assert "1 tensor missing: model.layers.1.mlp.down_proj.weight" in message
    assert "1 tensor the model has no place for: model.layers.1.mlp.router.weight" in message


@pytest.mark.timeout(200)
def test_nan_in_stage_1_alone_stops_stage_0_too(weights: Path, tmp_path: Path) -> None:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state["model.norm.weight"][0] = float("nan")

    message = refused(edited(weights, tmp_path / "d", edit), tmp_path)
    assert message.startswith("rank 1 on localhost: "), message
    assert "tensor 'model.norm.weight' holds NaN" in message
