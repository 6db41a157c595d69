"""--data-fn plug-ins, build_batches' choice of source, and SyntheticCorpus' protocol side."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from autohet_cli.dataset import DataError
from autohet_cli.dataset.sampling import TokenDataset
from autohet_cli.errors import ConfigError
from autohet_cli.runtime.data import SyntheticCorpus
from autohet_cli.runtime.data_api import (
    Batches,
    DataRequest,
    build_batches,
    can_evaluate,
    describe_batches,
    load_data_fn,
)

PLUGIN = '''
import torch

NOT_CALLABLE = 42


class Ramp:
    """Row r of step t is t * 1000 + r + [0, seq_len]: plan-independent by construction."""

    def __init__(self, request):
        self.request = request

    def microbatches(self, step, *, batch_size, sample_range, micro_batch_size):
        start, stop = sample_range
        base = step * 1000 + torch.arange(start, stop)[:, None]
        windows = base + torch.arange(self.request.seq_len + 1)
        return [
            (windows[i : i + micro_batch_size, :-1], windows[i : i + micro_batch_size, 1:])
            for i in range(0, stop - start, micro_batch_size)
        ]


def build(request):
    return Ramp(request)


def broken(request):
    return "not batches"
'''


def request(**overrides: object) -> DataRequest:
    fields: dict[str, object] = {
        "seq_len": 8,
        "seed": 3,
        "vocab_size": 256,
        "global_batch_size": 8,
        "micro_batch_size": 2,
    }
    fields.update(overrides)
    return DataRequest(**fields)  # type: ignore[arg-type]


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The name of a plug-in module written into tmp_path, importable for this test only."""
    name = f"autohet_test_data_plugin_{abs(hash(tmp_path)) % 10**9}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_plugin_is_loaded_and_used(plugin: str) -> None:
    req = request(data="/corpora/mine", data_dtype="uint32", val_fraction=0.01)
    batches = build_batches(req, data_fn=f"{plugin}:build")
    assert isinstance(batches, Batches)
    assert batches.request is req  # type: ignore[attr-defined]
    (x, y), (x2, _) = batches.microbatches(5, batch_size=8, sample_range=(2, 6), micro_batch_size=2)
    assert x[0, 0] == 5002 and x2[0, 0] == 5004 and y[0, 0] == 5003
    assert describe_batches(batches) == {"kind": f"{plugin}.Ramp"}
    assert not can_evaluate(batches)


def test_the_plugin_wins_over_data(plugin: str, tmp_path: Path) -> None:
    req = request(data=str(tmp_path / "does-not-exist.bin"))
    assert type(build_batches(req, data_fn=f"{plugin}:build")).__name__ == "Ramp"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_colon", "expected package.module:function"),
        (":build", "expected package.module:function"),
        ("{plugin}:", "expected package.module:function"),
        ("autohet_no_such_module_xyz:build", "cannot import autohet_no_such_module_xyz"),
        ("{plugin}:missing", "has no attribute 'missing'"),
        ("{plugin}:NOT_CALLABLE", "is a int, not a function"),
    ],
)
def test_bad_specs(plugin: str, spec: str, fragment: str) -> None:
    spec = spec.format(plugin=plugin)
    with pytest.raises(ConfigError) as info:
        load_data_fn(spec)
    assert f"--data-fn {spec!r}" in str(info.value) and fragment in str(info.value)


def test_a_plugin_returning_no_batches_is_refused(plugin: str) -> None:
    with pytest.raises(ConfigError, match="returned a str, which has no microbatches"):
        build_batches(request(), data_fn=f"{plugin}:broken")


def test_data_path_gives_a_token_dataset(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    batches = build_batches(
        request(data=str(tmp_path / "train.bin"), vocab_size=1000), data_fn=None
    )
    assert isinstance(batches, TokenDataset) and isinstance(batches, Batches)
    assert batches.seed == 3 and batches.seq_len == 8 and can_evaluate(batches)
    assert describe_batches(batches)["num_val_samples"] == 1
    with pytest.raises(DataError, match="vocabulary is 999 but train.bin holds id 999"):
        build_batches(request(data=str(tmp_path / "train.bin"), vocab_size=999), data_fn=None)
    (tmp_path / "odd.bin").write_bytes(bytes(7))
    with pytest.raises(DataError, match="--data-dtype uint32"):
        build_batches(request(data=str(tmp_path / "odd.bin")), data_fn=None)


def test_no_data_gives_the_synthetic_corpus() -> None:
    batches = build_batches(request(), data_fn=None)
    assert isinstance(batches, SyntheticCorpus) and isinstance(batches, Batches)
    assert (batches.vocab_size, batches.seq_len, batches.seed) == (256, 8, 3)
    with pytest.raises(ConfigError, match="--data-dtype is given without --data"):
        build_batches(request(data_dtype="uint32"), data_fn=None)


def test_synthetic_eval_batches_are_fixed_and_apart_from_training() -> None:
    corpus = SyntheticCorpus(vocab_size=256, seq_len=8, seed=3)
    kwargs = {"batch_size": 8, "micro_batch_size": 2}
    full = corpus.eval_microbatches(1, sample_range=(0, 8), **kwargs)
    again = SyntheticCorpus(vocab_size=256, seq_len=8, seed=3)
    halves = again.eval_microbatches(1, sample_range=(0, 4), **kwargs) + again.eval_microbatches(
        1, sample_range=(4, 8), **kwargs
    )
    for (x, y), (x2, y2) in zip(full, halves, strict=True):
        torch.testing.assert_close((x, y), (x2, y2))
    train = corpus.microbatches(1, sample_range=(0, 8), **kwargs)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(full, train, strict=True))
    other = corpus.eval_microbatches(2, sample_range=(0, 8), **kwargs)
    assert not torch.equal(full[0][0], other[0][0])
    assert corpus.describe() == {
        "kind": "synthetic",
        "vocab_size": 256,
        "seq_len": 8,
        "seed": 3,
        "num_tokens": len(corpus.tokens),
    }
    assert can_evaluate(corpus)


def test_a_headerless_file_for_a_big_vocabulary_needs_its_dtype(tmp_path: Path) -> None:
    import numpy as np

    from autohet_cli.dataset import DataError
    from autohet_cli.runtime.data_api import DataRequest, build_batches

    path = tmp_path / "train.bin"
    np.arange(4096, dtype=np.uint32).tofile(path)
    request = DataRequest(
        seq_len=8,
        seed=0,
        vocab_size=128_256,
        global_batch_size=2,
        micro_batch_size=1,
        data=str(path),
    )
    with pytest.raises(DataError, match="pass --data-dtype uint32"):
        build_batches(request, data_fn=None)
    from dataclasses import replace

    ok = build_batches(replace(request, data_dtype="uint32"), data_fn=None)
    assert ok.microbatches(0, batch_size=2, sample_range=(0, 2), micro_batch_size=1)
