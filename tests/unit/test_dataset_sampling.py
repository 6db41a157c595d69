"""TokenDataset: deterministic, plan-independent, epoch-complete batches and a fixed eval split.

The token files here hold ``0, 1, 2, ...`` so a window tells which sample it is:
sample ``i`` starts with token ``i * seq_len``.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from autohet_cli.dataset import DataError, vocab
from autohet_cli.dataset.formats import TokenSource, open_tokens
from autohet_cli.dataset.permutation import FeistelPermutation
from autohet_cli.dataset.sampling import TokenDataset, num_val_samples_for

SEQ_LEN = 4


def counting_source(tmp_path: Path, num_samples: int, seq_len: int = SEQ_LEN) -> TokenSource:
    path = tmp_path / f"count{num_samples}.bin"
    np.arange(num_samples * seq_len + 1, dtype=np.uint32).tofile(path)
    return open_tokens(path, dtype="uint32")


def sample_ids(inputs: torch.Tensor, seq_len: int = SEQ_LEN) -> list[int]:
    return (inputs[:, 0] // seq_len).tolist()


def rows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


@pytest.fixture
def dataset(tmp_path: Path) -> TokenDataset:
    """50 samples: 48 train, 2 validation (ceil(0.04 * 50))."""
    return TokenDataset(counting_source(tmp_path, 50), seq_len=SEQ_LEN, seed=7, val_fraction=0.04)


# ----------------------------------------------------------------- windows and splits


def test_windows_are_strided_and_targets_shifted(dataset: TokenDataset) -> None:
    inputs, targets = dataset.global_batch(3, 8)
    assert inputs.shape == targets.shape == (8, SEQ_LEN) and inputs.dtype == torch.int64
    starts = inputs[:, 0]
    assert (starts % SEQ_LEN == 0).all()
    torch.testing.assert_close(inputs, starts[:, None] + torch.arange(SEQ_LEN))
    torch.testing.assert_close(targets, inputs + 1)


def test_split_sizes(dataset: TokenDataset) -> None:
    assert (dataset.num_train_samples, dataset.num_val_samples) == (48, 2)
    assert num_val_samples_for(30, 0.1) == 3  # not ceil(3.0000000000000004)
    assert num_val_samples_for(1000, 0.005) == 5
    assert num_val_samples_for(2, 0.001) == 1  # at least one
    assert num_val_samples_for(1, 0.5) == 0  # the only sample trains
    assert num_val_samples_for(1000, 0.0) == 0


def test_determinism_in_seed_and_step(tmp_path: Path, dataset: TokenDataset) -> None:
    again = TokenDataset(counting_source(tmp_path, 50), seq_len=SEQ_LEN, seed=7, val_fraction=0.04)
    other_seed = TokenDataset(dataset.source, seq_len=SEQ_LEN, seed=8, val_fraction=0.04)
    for step in (0, 1, 5, 6, 100):
        torch.testing.assert_close(again.global_batch(step, 8), dataset.global_batch(step, 8))
    assert dataset.global_batch(0, 8)[0].tolist() != dataset.global_batch(1, 8)[0].tolist()
    orders = [sample_ids(d.global_batch(0, 48)[0]) for d in (dataset, other_seed)]
    assert orders[0] != orders[1]


@pytest.mark.parametrize("step", [0, 4, 9])  # step 4 with batch 10 straddles epochs 0 and 1
def test_any_split_of_the_range_gives_the_same_rows(dataset: TokenDataset, step: int) -> None:
    full = dataset.global_batch(step, 10)
    for cuts in ([0, 10], [0, 3, 10], [0, 4, 6, 10], [0, 2, 4, 6, 8, 10]):
        parts = [
            rows(dataset.microbatches(step, batch_size=10, sample_range=(a, b), micro_batch_size=2))
            for a, b in zip(cuts, cuts[1:], strict=False)
        ]
        torch.testing.assert_close(tuple(torch.cat(p) for p in zip(*parts, strict=True)), full)


def test_microbatches_are_cut_like_synthetic(dataset: TokenDataset) -> None:
    batches = dataset.microbatches(2, batch_size=8, sample_range=(2, 8), micro_batch_size=2)
    inputs, _ = dataset.global_batch(2, 8)
    assert len(batches) == 3 and all(x.shape == (2, SEQ_LEN) for x, _ in batches)
    torch.testing.assert_close(batches[1][0], inputs[4:6])
    with pytest.raises(ValueError, match="sample_range"):
        dataset.microbatches(0, batch_size=8, sample_range=(4, 9), micro_batch_size=2)


# ----------------------------------------------------------------- epochs


def test_every_epoch_visits_every_train_sample_once_in_a_new_order(dataset: TokenDataset) -> None:
    def epoch(e: int) -> list[int]:  # batch 8 divides the 48 training samples: 6 steps
        return [
            i
            for step in range(6 * e, 6 * e + 6)
            for i in sample_ids(dataset.global_batch(step, 8)[0])
        ]

    orders = [epoch(e) for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(48))
    assert orders[0] != orders[1] != orders[2]
    assert dataset.epoch_of(6, 8) == 1.0 and dataset.epoch_of(9, 8) == 1.5


def test_epochs_are_complete_when_the_batch_does_not_divide_them(dataset: TokenDataset) -> None:
    seen = [i for step in range(0, 96 // 12) for i in sample_ids(dataset.global_batch(step, 12)[0])]
    assert sorted(seen[:48]) == sorted(seen[48:]) == list(range(48))


def test_validation_samples_never_train(dataset: TokenDataset) -> None:
    for step in range(30):
        assert max(sample_ids(dataset.global_batch(step, 8)[0])) < 48


# ----------------------------------------------------------------- evaluation


def test_eval_batches_are_fixed_and_in_order(tmp_path: Path, dataset: TokenDataset) -> None:
    def eval_ids(d: TokenDataset, index: int, sample_range: tuple[int, int] = (0, 3)) -> list[int]:
        got = d.eval_microbatches(
            index, batch_size=3, sample_range=sample_range, micro_batch_size=1
        )
        return sample_ids(rows(got)[0])

    assert eval_ids(dataset, 0) == [48, 49, 48]  # validation samples 0, 1, 2 mod 2
    assert eval_ids(dataset, 1) == [49, 48, 49]  # 3, 4, 5 mod 2
    assert eval_ids(dataset, 0, (1, 3)) == [49, 48]
    again = TokenDataset(counting_source(tmp_path, 50), seq_len=SEQ_LEN, seed=99, val_fraction=0.04)
    assert eval_ids(again, 1) == eval_ids(dataset, 1)  # not shuffled: the seed plays no part


def test_no_validation_split(tmp_path: Path) -> None:
    d = TokenDataset(counting_source(tmp_path, 10), seq_len=SEQ_LEN, seed=0, val_fraction=0)
    assert (d.num_train_samples, d.num_val_samples) == (10, 0)
    with pytest.raises(DataError, match="no validation samples"):
        d.eval_microbatches(0, batch_size=2, sample_range=(0, 2), micro_batch_size=1)


# ----------------------------------------------------------------- refusals


def test_bad_val_fraction_or_too_little_data(tmp_path: Path) -> None:
    source = counting_source(tmp_path, 2)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(DataError, match="--val-fraction"):
            TokenDataset(source, seq_len=SEQ_LEN, seed=0, val_fraction=bad)
    with pytest.raises(DataError, match="holds out all 2 samples"):
        TokenDataset(source, seq_len=SEQ_LEN, seed=0, val_fraction=0.9)
    with pytest.raises(DataError, match=r"count2\.bin: 9 tokens is too few .* seq_len 9"):
        TokenDataset(source, seq_len=9, seed=0)


def write_ids(path: Path, ids: np.ndarray) -> TokenSource:
    ids.astype(np.uint16).tofile(path)
    return open_tokens(path)


def test_vocab_check(tmp_path: Path) -> None:
    ids = np.arange(4000) % 1000
    ids[2500] = 50256
    source = write_ids(tmp_path / "gpt2.bin", ids)
    message = "the model's vocabulary is 1024 but gpt2.bin holds id 50256"
    with pytest.raises(DataError, match=message):
        TokenDataset(source, seq_len=SEQ_LEN, seed=0, vocab_size=1024)
    TokenDataset(source, seq_len=SEQ_LEN, seed=0, vocab_size=50257)


def test_vocab_check_samples_huge_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocab, "FULL_SCAN_MAX_TOKENS", 1000)
    monkeypatch.setattr(vocab, "SAMPLE_CHUNK_TOKENS", 10)
    ids = np.zeros(100_000, dtype=np.uint16)
    ids[-1] = 60_000  # the last chunk is always sampled
    source = write_ids(tmp_path / "big.bin", ids)
    with pytest.raises(DataError, match="holds id 60000 .in 64 chunks sampled"):
        TokenDataset(source, seq_len=SEQ_LEN, seed=0, vocab_size=50257)
    ids[-1], ids[50_000] = 0, 60_000  # between sampled chunks: a sample can miss it
    assert vocab.id_range(write_ids(tmp_path / "big2.bin", ids)).complete is False


# ----------------------------------------------------------------- the permutation


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 1000, 4096, 4097, 65_537])
def test_feistel_is_a_bijection(size: int) -> None:
    perm = FeistelPermutation.keyed(size, "test", size)
    image = perm(np.arange(size))
    assert image.dtype == np.int64
    np.testing.assert_array_equal(np.sort(image), np.arange(size))


def test_feistel_depends_on_its_key_and_shuffles() -> None:
    a = FeistelPermutation.keyed(1000, "train", 0, 0)(np.arange(1000))
    b = FeistelPermutation.keyed(1000, "train", 0, 1)(np.arange(1000))
    assert (a != b).mean() > 0.9
    assert (a == np.arange(1000)).sum() < 20  # not near the identity


def test_a_billion_samples_cost_no_memory() -> None:
    perm = FeistelPermutation.keyed(10**9, "train", 0, 0)
    positions = np.array([0, 1, 2, 123_456_789, 10**9 - 1])
    tracemalloc.start()
    try:
        image = perm(positions)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a materialised permutation would be 8 GB
    assert len(set(image.tolist())) == 5 and 0 <= image.min() and image.max() < 10**9


def test_a_billion_sample_dataset_serves_batches(tmp_path: Path) -> None:
    path = tmp_path / "sparse.bin"
    with path.open("wb") as f:  # a sparse file: 2 GB long, no disk used
        f.truncate(2 * (10**9 + 1))
    d = TokenDataset(open_tokens(path), seq_len=1, seed=0, val_fraction=0)
    assert d.num_train_samples == 10**9
    ((x, y),) = d.microbatches(10**7, batch_size=4, sample_range=(0, 4), micro_batch_size=4)
    assert x.shape == y.shape == (4, 1)


# ----------------------------------------------------------------- records


def test_describe(dataset: TokenDataset) -> None:
    described = dataset.describe()
    assert described["fingerprint"] == dataset.source.fingerprint()
    assert {
        k: described[k] for k in ("seq_len", "seed", "num_train_samples", "num_val_samples")
    } == {
        "seq_len": SEQ_LEN,
        "seed": 7,
        "num_train_samples": 48,
        "num_val_samples": 2,
    }
    json.dumps(described)
