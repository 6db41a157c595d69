"""``--init-from`` refuses what it cannot train from, by name, and never hangs.

Red-team inputs (issue 29): int8 weights with bitsandbytes' ``SCB`` scales and an
F32 tensor relabelled I32 were cast to float and trained; header bombs, offsets
past the end, a malformed index and ``weight_map`` paths outside the directory
ended in tracebacks; an index naming a FIFO hung the launch; NaN weights trained.
Each directory here is gpt-tiny's weights as HuggingFace names them, written with
safetensors (and damaged by hand where the attack needs it).
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from autohet_cli.errors import AutohetError, ConfigError
from autohet_cli.hfconfig import load_hf_config, to_hf_config
from autohet_cli.models import get_model
from autohet_cli.runtime.hf_weights import load_hf_weights
from tests.hf_reference import hf_state, tiny_model

SPEC = get_model("gpt-tiny")
QKV = "transformer.h.0.attn.c_attn.weight"


def hf_dir(path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(to_hf_config(SPEC)))
    save_file(hf_state() if state is None else state, str(path / "model.safetensors"))
    return path


def load(directory: Path) -> int:
    return load_hf_weights(tiny_model(), SPEC, directory)


def refusal(directory: Path) -> str:
    start = time.monotonic()
    with pytest.raises(AutohetError) as info:  # HFWeightsError; ConfigError for config.json
        load(directory)
    assert time.monotonic() - start < 10  # never waits on what it reads
    return str(info.value)


def test_a_good_directory_loads_and_float_dtypes_cast(tmp_path: Path) -> None:
    assert load(hf_dir(tmp_path / "f32")) == 69
    state = hf_state()
    state[QKV] = state[QKV].to(torch.float16)
    state["transformer.wte.weight"] = state["transformer.wte.weight"].to(torch.bfloat16)
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"].to(torch.float64)
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # an old GPT-2 buffer
    model = tiny_model()
    assert load_hf_weights(model, SPEC, hf_dir(tmp_path / "mixed", state)) == 69
    wpe = dict(model.named_parameters())["layers.0.wpe.weight"]
    assert torch.equal(wpe, state["transformer.wpe.weight"].float())


def test_int8_weights_with_scales_are_refused_by_name(tmp_path: Path) -> None:
    state = hf_state()
    weight = state[QKV]
    scale = weight.abs().amax(dim=0) / 127  # bitsandbytes' LLM.int8 row scales
    state[QKV] = torch.round(weight / scale).to(torch.int8)
    state[QKV.replace(".weight", ".SCB")] = scale
    state[QKV.replace(".weight", ".weight_format")] = torch.tensor(0, dtype=torch.uint8)
    message = refusal(hf_dir(tmp_path, state))
    assert f"model.safetensors: tensor '{QKV}' is I8" in message
    assert "transformer.h.0.attn.c_attn.SCB" in message and "unused" in message
    assert "dequantize" in message


@pytest.mark.parametrize(("dtype", "size"), [("I32", 4), ("I64", 8), ("BOOL", 1), ("F8_E4M3", 1)])
def test_a_tensor_relabelled_as_another_dtype_is_refused(
    tmp_path: Path, dtype: str, size: int
) -> None:
    d = hf_dir(tmp_path)
    shape = [64, 192 * 4 // size]  # the same bytes (F32 -> I32: the same shape too)
    _edit_header(d / "model.safetensors", lambda h: h[QKV].update(dtype=dtype, shape=shape))
    message = refusal(d)
    assert f"tensor '{QKV}' is {dtype}" in message and "dequantize" in message


def test_quantization_scales_beside_float_weights_are_refused(tmp_path: Path) -> None:
    state = hf_state()
    state["transformer.h.1.mlp.c_fc.weight_scale_inv"] = torch.ones(2, 2)
    message = refusal(hf_dir(tmp_path, state))
    assert "transformer.h.1.mlp.c_fc.weight_scale_inv" in message and "dequantize" in message


def test_nan_or_overflowing_weights_are_refused_by_name(tmp_path: Path) -> None:
    state = hf_state()
    state["transformer.h.2.ln_1.bias"][3] = float("nan")
    message = refusal(hf_dir(tmp_path / "nan", state))
    assert "tensor 'transformer.h.2.ln_1.bias' holds NaN or infinite values" in message
    state = hf_state()
    state[QKV] = state[QKV].double()
    state[QKV][0, 0] = 1e300  # finite in F64, infinite in the model's float32
    assert f"tensor '{QKV}' holds" in refusal(hf_dir(tmp_path / "big", state))


def _edit_header(path: Path, edit: Callable[[dict[str, dict[str, object]]], None]) -> None:
    """Rewrite a safetensors header in place (its data unchanged), as an attacker would."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_damaged_safetensors_files_are_refused_with_the_file_named(tmp_path: Path) -> None:
    d = hf_dir(tmp_path / "bomb")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    assert "model.safetensors: header length 4611686018427387904 bytes" in refusal(d)
    d = hf_dir(tmp_path / "past")
    _edit_header(d / "model.safetensors", lambda h: h[QKV].update(data_offsets=[0, 1 << 40]))
    assert f"model.safetensors: tensor '{QKV}': data_offsets" in refusal(d)
    d = hf_dir(tmp_path / "overlap")
    _edit_header(d / "model.safetensors", lambda h: h[QKV].update(data_offsets=[0, 64 * 192 * 4]))
    assert "data_offsets [0, 49152] overlap another tensor" in refusal(d)
    d = hf_dir(tmp_path / "metadata")
    _edit_header(d / "model.safetensors", lambda h: h.update(__metadata__=5))
    assert "model.safetensors: header field '__metadata__'" in refusal(d)
    d = hf_dir(tmp_path / "deep")
    text = b"[" * 100_000
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    assert "model.safetensors: header is not valid JSON (nested too deeply)" in refusal(d)
    d = hf_dir(tmp_path / "short")
    (d / "model.safetensors").write_bytes(b"\x01")
    assert "too short for a safetensors file" in refusal(d)


def _indexed(tmp_path: Path, index: object) -> Path:
    d = hf_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(
        index if isinstance(index, str) else json.dumps(index)
    )
    return d


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ({"metadata": {}}, "field 'weight_map' must map tensor names to safetensors files"),
        ({"weight_map": ["model.safetensors"]}, "got a list"),
        ("[" * 100_000, "index is not valid JSON (nested too deeply)"),
        ("{not json", "index is not valid JSON"),
        ([1], "expected a JSON object"),
        ({"weight_map": {QKV: "/etc/passwd"}}, "must name a file inside the model directory"),
        ({"weight_map": {QKV: "../model.safetensors"}}, "must name a file inside"),
        ({"weight_map": {QKV: "absent.safetensors"}}, "absent.safetensors: cannot read"),
        ({"weight_map": {"not.a.tensor": "model.safetensors"}}, "does not hold it"),
    ],
)
def test_a_malformed_index_is_refused_with_the_file_named(
    tmp_path: Path, index: object, needle: str
) -> None:
    message = refusal(_indexed(tmp_path, index))
    assert "model.safetensors.index.json" in message or "absent" in message, message
    assert needle in message, message


def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    d = _indexed(tmp_path / "fifo", {"weight_map": {QKV: "pipe.safetensors"}})
    os.mkfifo(d / "pipe.safetensors")
    assert "pipe.safetensors: is a named pipe (FIFO), not a regular file" in refusal(d)
    d = hf_dir(tmp_path / "fifo-index")
    os.mkfifo(d / "model.safetensors.index.json")
    assert "index.json: is a named pipe (FIFO)" in refusal(d)
    d = hf_dir(tmp_path / "device")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/dev/zero")
    assert "model.safetensors: is a character device" in refusal(d)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "loop: cannot open the --init-from directory" in refusal(loop)
    d = hf_dir(tmp_path / "sub")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    assert "model.safetensors: is a directory" in refusal(d)


def test_a_config_json_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="is a named pipe"):
        load_hf_config(str(tmp_path / "config.json"))
    d = hf_dir(tmp_path / "hf")
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    assert "config.json: is a named pipe" in refusal(d)


def test_a_symlinked_hub_cache_layout_loads(tmp_path: Path) -> None:
    """The HF cache links snapshots/<rev>/model.safetensors to ../../blobs/<hash>:
    links are followed; only the index's names must stay inside the directory."""
    blobs = hf_dir(tmp_path / "blobs")
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (snap / f).symlink_to(blobs / f)
    (snap / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(hf_state(), "model.safetensors")})
    )
    assert load(snap) == 69


@pytest.mark.parametrize(
    ("rope", "needle"),
    [
        ({"rope_type": "linear", "factor": 1e-300}, "rope_scaling.factor: 1e-300 is outside"),
        ({"rope_type": "linear", "factor": 0}, "'factor' must be a positive number"),
        ({"rope_type": "linear", "factor": -2.0}, "'factor' must be a positive number"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor: expected a finite number"),
        ({"rope_type": "linear", "factor": float("inf")}, "factor: expected a finite number"),
        ({"rope_type": "linear", "factor": 1e300}, "rope_scaling.factor: 1e+300 is outside"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "high_freq_factor (4.0) must exceed low_freq_factor (4.0)",
        ),  # fmt: skip
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": float("nan"),
                "original_max_position_embeddings": 16,
            },
            "low_freq_factor: expected a finite number",
        ),  # fmt: skip
    ],
)
def test_absurd_rope_scaling_is_refused_at_plan_time(
    tmp_path: Path, rope: dict[str, object], needle: str
) -> None:
    config = {**_llama_config(), "rope_scaling": rope}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_hf_config(str(path))
    assert str(path) in str(info.value) and needle in str(info.value), str(info.value)


@pytest.mark.parametrize(("key", "value"), [("rope_theta", 1e-300), ("rms_norm_eps", 5.0)])
def test_absurd_rotary_base_or_norm_eps_is_refused(tmp_path: Path, key: str, value: float) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_llama_config(), key: value}))
    with pytest.raises(ConfigError, match="is outside"):
        load_hf_config(str(path))


def _llama_config() -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 250,
        "max_position_embeddings": 64,
    }
