"""A one-off gradient-norm spike gets one line in the step output (runtime.spikes)."""

from __future__ import annotations

from autohet_cli.runtime.spikes import MIN_HISTORY, SpikeWatch


def _feed(watch: SpikeWatch, norms: list[float]) -> list[tuple[int, str]]:
    out = []
    for step, norm in enumerate(norms, start=1):
        if (remark := watch.observe(step, norm)) is not None:
            out.append((step, remark))
    return out


def test_a_one_off_spike_is_named_with_its_ratio_and_what_clipping_did() -> None:
    norms = [0.5, 0.45, 0.52, 0.48, 0.5, 0.47, 6.0, 0.49, 0.5, 0.46]
    [(step, remark)] = _feed(SpikeWatch(grad_clip=1.0), norms)
    assert step == 7
    assert "gradient norm spike: 6.000 is 12.2x the median of the last 6 steps (0.490)" in remark
    assert "clipped to 1 (--grad-clip)" in remark and "lower --lr" in remark


def test_steady_or_slowly_rising_norms_and_early_steps_say_nothing() -> None:
    assert _feed(SpikeWatch(grad_clip=1.0), [0.5 * 1.05**i for i in range(60)]) == []
    # early training: norms fall fast from large values; no verdict before the history
    early = [50.0, 5.0, 2.0, 1.0, 0.6][: MIN_HISTORY - 1] + [30.0]
    assert _feed(SpikeWatch(), early) == []


def test_without_clipping_it_says_the_update_was_not_bounded() -> None:
    [(_, remark)] = _feed(SpikeWatch(grad_clip=0.0), [1.0] * 8 + [9.0])
    assert "not clipped (--grad-clip bounds such updates)" in remark


def test_non_finite_norms_are_left_to_the_non_finite_guard() -> None:
    watch = SpikeWatch(grad_clip=1.0)
    assert _feed(watch, [1.0] * 8 + [float("nan"), float("inf"), None]) == []  # type: ignore[list-item]


def test_rank_0s_step_lines_carry_the_remark(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Through the metrics hook the trainer calls: the spike's line follows its step line."""
    from types import SimpleNamespace

    from autohet_cli.runtime.hooks import MetricsHook
    from autohet_cli.runtime.metrics import StepResult

    hook = MetricsHook(tmp_path / "metrics.jsonl")
    # the two attributes the hook reads of the trainer: rank and the clip setting
    trainer = SimpleNamespace(
        runtime=SimpleNamespace(global_rank=0), config=SimpleNamespace(grad_clip=1.0)
    )
    hook.on_train_start(trainer)  # type: ignore[arg-type]
    for step, norm in enumerate([0.5] * 6 + [5.0], start=1):
        hook.on_step_end(
            trainer, StepResult(step=step, loss=3.0, tokens=64, time_s=0.1, grad_norm=norm)
        )  # type: ignore[arg-type]
    hook.on_train_end(trainer)  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("step 7 loss 3.000000") and "grad_norm 5.000" in lines[-2]
    assert lines[-1].startswith("note: step 7: gradient norm spike: 5.000 is 10.0x")
    assert sum("spike" in ln for ln in lines) == 1
