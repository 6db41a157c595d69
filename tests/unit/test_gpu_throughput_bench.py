"""benchmarks/gpu_throughput: its FLOP count and its model config.

The harness end to end (its CPU smoke mode) is tests/e2e/test_gpu_throughput_harness.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autohet_cli.hfconfig import load_hf_config
from autohet_cli.models import ModelSpec
from benchmarks.gpu_throughput import BIG, flops_per_token, hf_config


def test_the_bench_model_is_the_issues_1_2b_llama(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps(hf_config(BIG)))
    spec: ModelSpec = load_hf_config(path)
    assert spec.num_params == pytest.approx(1.236e9, rel=0.01)
    assert spec.tied_embeddings and spec.padded_vocab_size == 128256
    # 6N + 12 L h s: what the issue's MFU column counts
    n = spec.num_params
    assert flops_per_token(BIG) == pytest.approx(6 * n + 12 * 16 * 2048 * 2048, rel=1e-3)
