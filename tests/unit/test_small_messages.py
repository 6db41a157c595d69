"""Issue 46 item 8: what small outputs say (numbers a person reads, not dumps)."""

from __future__ import annotations

from pathlib import Path

from autohet_cli.cli.models import params_text
from autohet_cli.recovery.report import dry_run_text, phases_text


def test_parameter_counts_use_the_unit_that_reads() -> None:
    assert params_text(354_600) == "354.6K"
    assert params_text(124_439_808) == "124.4M"
    assert params_text(6_738_415_616) == "6.738B"
    assert params_text(999) == "999"


def test_recover_says_its_phases_and_dry_run_as_lines() -> None:
    assert phases_text({"detect": 0.41, "transfer": 1.25}) == (
        "detect 0.4 s, transfer 1.2 s (total 1.7 s)"
    )
    lines = dry_run_text(
        {
            "lost": ["fake-4"],
            "step": 6,
            "job": "J",
            "new_plan_hosts": ["fake-2", "fake-3"],
            "plan_diff": {"old": ["m=2: a"], "new": ["m=2: b"]},
            "transfers": {"items": [{}], "bytes_from_peers": 2048, "rule": "R"},
            "notes": ["recovered from the loss of fake-4"],
            "paths": {"fake-2": {"--data": "/d"}, "fake-3": {}},
        }
    )
    text = "\n".join(lines)
    assert "{" not in text
    # A checkpoint's step says which logged step it follows, as every message does.
    assert "  lost: fake-4; resume job J at checkpoint step 6 (after step 5)" in lines
    assert "    was m=2: a" in lines and "    now m=2: b" in lines
    assert "1 file(s), 2,048 B from peers, 0 B from remote storage (rule R" in text
    assert "  paths on fake-2: --data /d" in lines and "fake-3:" not in text
    assert "  note: recovered from the loss of fake-4" in lines


def test_a_step_copied_without_its_job_key_names_the_key_file(tmp_path: Path) -> None:
    """export of a step copied alone said "no job key on this host": which file, where?"""
    from autohet_cli.ckpt.files import incomplete_reason

    step = tmp_path / "copied" / "step-00000030"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "manifest.json").write_text("{}")
    why = incomplete_reason(step, None)
    assert why is not None and f"no job key {tmp_path}/copied/.autohet-key" in why, why
    assert "needs its job directory's .autohet-key beside it, mode 0600" in why
