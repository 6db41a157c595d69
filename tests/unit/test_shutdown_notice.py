"""One notice however a shutdown's SIGTERMs arrive: the agent's rule, the worker's rule,
the launcher's rule, the checkpoint hook's emergency save, the spot-notice estimate."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from autohet_cli.ckpt.notice import notice_warnings, save_bytes_per_host
from autohet_cli.ckpt.persist import SaveRecord
from autohet_cli.launch import triage
from autohet_cli.launch.session import survivors
from autohet_cli.launch.supervise import stop_on_signals as _stop_on_signals
from autohet_cli.models import get_model
from autohet_cli.plan import Plan
from autohet_cli.runtime.agent import NoticeClock, child_pids, patched_handler
from autohet_cli.runtime.checkpoint_hook import CheckpointHook
from autohet_cli.runtime.preempt import Notices
from tests.planting import plan_of, stage

# ------------------------------------------------------------------ the agent


def test_the_clock_makes_repeats_within_the_window_one_notice() -> None:
    clock = NoticeClock(window_s=10)
    assert clock.absorb(100.0) is None  # the notice
    assert clock.absorb(100.001) is True and clock.absorb(109.9) is True
    assert clock.absorb(110.5) is False  # later: a stop that will not wait


def test_the_agents_first_sigterm_is_forwarded_once_and_repeats_never_reach_torchrun() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = [0.0]
        calls: list[int] = []
        handler = patched_handler(
            lambda s, _f: calls.append(s),
            NoticeClock(10),
            now=lambda: now[0],
            children=lambda: [sleeper.pid],
        )
        handler(signal.SIGTERM, None)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM  # forwarded to the worker
        now[0] = 3.0
        handler(signal.SIGTERM, None)  # the shutdown again: the same notice
        assert calls == []
        handler(signal.SIGINT, None)  # a person's Ctrl-C: torchrun's own handling
        now[0] = 20.0
        handler(signal.SIGTERM, None)  # past the window: stop now
        assert calls == [signal.SIGINT, signal.SIGTERM]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_child_pids_finds_the_agents_workers() -> None:
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert kid.pid in child_pids(os.getpid())
    finally:
        kid.kill()
        kid.wait()


# ------------------------------------------------------------------ the worker


def test_the_worker_records_one_notice_and_dies_only_past_the_window() -> None:
    notices = Notices(window_s=10)
    assert notices.first() is None
    assert notices.on_sigterm(50.0) is True
    why, at = notices.first()  # type: ignore[misc]
    assert why == "SIGTERM" and abs(at - time.time()) < 60
    assert notices.on_sigterm(50.2) is True and notices.on_sigterm(59.0) is True
    notices.notify("preemption check: later")  # the first notice wins
    assert notices.first() == (why, at)
    assert notices.on_sigterm(61.0) is False


_SAVED_AND_EXITING = """
import os, signal, sys, time
from autohet_cli.runtime.preempt import notices
notices().install()
print("ready", flush=True)
time.sleep(0.2)  # the save; then main returns
notices().hold_through_exit() if sys.argv[1] == "held" else None
sys.exit(0)
"""


@pytest.mark.parametrize("held", [True, False])
def test_a_worker_that_saved_survives_the_shutdowns_repeats_to_its_last_instruction(
    held: bool,
) -> None:
    """A shutdown's SIGTERMs keep coming (here: one per millisecond) while the worker
    that saved is exiting. The interpreter's teardown puts Python-handled signals back
    to SIG_DFL, so without hold_through_exit one of them kills it (-15, which torchrun
    reports as a failed worker: seen on torch 2.13 in tests/dist/test_preempt.py)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SAVED_AND_EXITING, "held" if held else "not"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    while child.poll() is None:
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.001)
    assert child.wait() == (0 if held else -signal.SIGTERM)


# ------------------------------------------------------------------ emergency saves


class _Saver:
    def __init__(self) -> None:
        self.saved: list[int] = []
        self.trainer: SimpleNamespace | None = None

    def save(self, *, last: bool = False) -> None:
        assert self.trainer is not None
        self.saved.append(self.trainer.step)

    def close(self) -> None:
        pass

    def agree_max(self, values: list[float]) -> list[float]:
        return [v + 100.0 for v in values]  # another rank saved far slower


def _run(hook: CheckpointHook, steps: int, *, preempted: bool) -> list[int]:
    saver = hook.checkpointer
    assert isinstance(saver, _Saver)
    trainer = SimpleNamespace(step=0, runtime=SimpleNamespace(global_rank=0), stop_reason=None)
    saver.trainer = trainer
    hook.on_train_start(trainer)  # type: ignore[arg-type]
    for _ in range(steps):
        trainer.step += 1
        hook.on_step_end(trainer, SimpleNamespace(time_s=0.01))  # type: ignore[arg-type]
    trainer.stop_reason = "preempted" if preempted else None
    hook.on_train_end(trainer)  # type: ignore[arg-type]
    return saver.saved


def test_checkpoint_every_0_still_saves_a_notices_step_unless_told_not_to() -> None:
    assert _run(CheckpointHook(_Saver(), 0), 5, preempted=True) == [5]
    assert _run(CheckpointHook(_Saver(), 0), 5, preempted=False) == [5]  # the final save
    assert _run(CheckpointHook(_Saver(), 0, emergency=False), 5, preempted=True) == []
    # Periodic saves on: --no-emergency-save skips the notice's save, not the schedule.
    assert _run(CheckpointHook(_Saver(), 2, emergency=False), 5, preempted=True) == [2, 4]
    assert _run(CheckpointHook(_Saver(), 2), 5, preempted=True) == [2, 4, 5]


class _SlowSaver(_Saver):
    """Saves that take 100 s to be durable on the slowest host (the record says so)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Callable[[SaveRecord], None]] = []

    def save(self, *, last: bool = False) -> None:
        super().save(last=last)
        assert self.trainer is not None
        record = SaveRecord(step=self.trainer.step, blocked_s=0.1, persist_s=100.0, nbytes=1)
        for listener in self.listeners:
            listener(record)


def test_a_save_longer_than_a_spot_notice_is_warned_about_once() -> None:
    """The figure that matters is the time to a durable step (an emergency save waits
    for it), not the time training was blocked."""
    said: list[str] = []
    hook = CheckpointHook(_SlowSaver(), 2, say=said.append, notice_budget_s=30.0)
    _run(hook, 5, preempted=False)
    warnings = [s for s in said if s.startswith("warning: a save takes")]
    assert (
        len(warnings) == 1 and "100.0 s to be durable, longer than the 30 s notice" in warnings[0]
    )
    assert [r.step for r in hook.records] == [2, 4, 5]
    quick: list[str] = []
    _run(CheckpointHook(_Saver(), 2, say=quick.append, notice_budget_s=30.0), 5, preempted=False)
    assert not quick


# ------------------------------------------------------------------ the launcher


def _plan(host_layers: dict[str, tuple[int, int]]) -> Plan:
    stages = [stage(a, b, h) for h, (a, b) in host_layers.items()]
    return plan_of(stages, microbatches=4, model=get_model("llama-tiny"), name="p")


def test_the_launch_estimate_names_spot_hosts_whose_save_would_not_fit_the_notice() -> None:
    n = get_model("llama-tiny").num_layers
    plan = _plan({"a": (0, 2), "b": (2, n)})
    sizes = save_bytes_per_host(plan)
    assert sizes["b"] > sizes["a"] > 0
    # Adam: 4 bytes of fp32 weight and 8 of moments per parameter.
    layers = plan.architecture.layers()  # type: ignore[union-attr]
    assert sizes["a"] == 12 * sum(x.num_params for x in layers[:2])
    slow = sizes["b"] / 1e9 / 40  # b takes 40 s at this rate, a less than 30
    said = notice_warnings(plan, lambda h: True, write_gbps=slow)
    assert len(said) == 1 and "spot host b" in said[0] and "estimated" in said[0]
    assert notice_warnings(plan, lambda h: h == "a", write_gbps=slow) == []
    measured = notice_warnings(plan, lambda h: h == "a", measured_s={"a": 45.0})
    assert len(measured) == 1 and "45 s (measured)" in measured[0]
    sgd = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer="sgd"))
    assert save_bytes_per_host(sgd)["a"] == sizes["a"] * 8 // 12


def test_a_stop_the_workers_saved_is_an_interruption_with_its_step() -> None:
    saved = triage.Preemption(hosts=(("h", "SIGTERM"),), step=7, saved=True)
    done = triage.Verdict(status=triage.FINISHED, exit_code=0)
    v = triage.stopped_on_request(done, saved)
    assert v.status == triage.INTERRUPTED and v.exit_code == 130 and "saved step 7" in v.detail
    unsaved = dataclasses.replace(saved, saved=False)
    failed = triage.Verdict(status=triage.FAILED, exit_code=1, detail="rank 1 died")
    assert "no step was saved (rank 1 died)" in triage.stopped_on_request(failed, unsaved).detail


def test_the_recover_hint_needs_a_survivor() -> None:
    # Of the plan's hosts (tests/unit/test_launch_hints.py: not the cluster's).
    assert survivors(["a", "b"], ["a"]) == ["b"]
    assert survivors(["a", "b"], ["a", "b"]) == []


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals: main thread"
)
def test_the_launcher_takes_a_shutdowns_repeats_as_one_and_a_second_ctrl_c_as_stop_now() -> None:
    for repeat, kills in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        stop, again = threading.Event(), threading.Event()
        job = SimpleNamespace(stop_signal=None)
        with _stop_on_signals(stop, again, job):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert stop.is_set() and not again.is_set() and job.stop_signal == signal.SIGTERM
            os.kill(os.getpid(), repeat)
            time.sleep(0.05)
            assert again.is_set() is kills
