"""--keep-checkpoints, the pure choice: newest K complete kept, pinned kept, the rest untouched."""

from __future__ import annotations

import pytest

from autohet_cli.ckpt.retention import (
    DEFAULT_KEEP,
    Pin,
    choose_prune,
    deleting_name,
    describe_keep,
    keep_of,
    parse_keep,
    parse_pin_name,
    pin_from_text,
    pin_holds,
    pin_name,
    pin_to_text,
    prune_message,
)
from autohet_cli.errors import ConfigError


def _steps(*steps: int) -> list[str]:
    return [f"step-{s:08d}" for s in steps]


def test_the_newest_k_complete_steps_are_kept_and_older_complete_ones_go() -> None:
    prune = choose_prune(_steps(10, 20, 30, 40, 50), complete={10, 20, 30, 40, 50}, keep=3)
    assert prune.remove == (10, 20) and prune.kept == (30, 40, 50)
    assert prune.pinned == () and prune.leftovers == () and not prune.empty


def test_keep_zero_keeps_every_step() -> None:
    prune = choose_prune(_steps(1, 2, 3), complete={1, 2, 3}, keep=0)
    assert prune.remove == () and prune.kept == (1, 2, 3) and prune.empty
    with pytest.raises(ValueError, match="keep must be >= 0"):
        choose_prune([], complete=set(), keep=-1)


def test_a_pinned_step_is_kept_beyond_k_and_said_to_be_pinned() -> None:
    prune = choose_prune(_steps(10, 20, 30, 40), complete={10, 20, 30, 40}, keep=2, pinned={10})
    assert prune.remove == (20,) and prune.kept == (10, 30, 40) and prune.pinned == (10,)
    # A pin of a step that is not complete (or gone) changes nothing.
    assert choose_prune(_steps(10, 20), complete={10, 20}, keep=1, pinned={99}).remove == (10,)


def test_incomplete_steps_saves_in_flight_and_unknown_names_are_untouched() -> None:
    names = [
        *_steps(5, 10, 20, 30),  # 5: no COMPLETE anywhere (recover filling it, or planted)
        ".tmp-step-00000040",  # a save in flight
        ".autohet-key",
        ".pin-step-00000010-ab12.json",
        "notes.txt",
        "step-7",  # not the step-<N:08d> form
        "step-0000001x",
        ".del-step-00000003",  # no token: not ours
    ]
    prune = choose_prune(names, complete={10, 20, 30}, keep=1)
    assert prune.remove == (10, 20) and prune.leftovers == () and prune.kept == (30,)


def test_completeness_is_the_jobs_over_every_host() -> None:
    """Only rank 0's host holds COMPLETE: another host's directory (data files only)
    is pruned by the job's complete steps; complete steps it lacks are nothing to it."""
    prune = choose_prune(_steps(2, 4), complete={2, 4, 6, 8}, keep=2)
    assert prune.remove == (2, 4) and prune.kept == (6, 8)
    # A host whose newest step is not complete (its COMPLETE host is gone) keeps it.
    assert choose_prune(_steps(8, 9), complete={2, 4, 6, 8}, keep=1).remove == ()


def test_leftovers_of_an_interrupted_removal_are_finished() -> None:
    left = deleting_name(10, "beef")
    assert left == ".del-step-00000010-beef"
    prune = choose_prune([left, *_steps(20)], complete={20}, keep=1)
    assert prune.remove == () and prune.leftovers == (left,) and not prune.empty
    with pytest.raises(ValueError, match="token"):
        deleting_name(1, "../x")


def test_the_flag_parses_counts_and_zero_and_names_itself_on_errors() -> None:
    assert parse_keep("0") == 0 and parse_keep(" 3 ") == 3 and parse_keep(5) == 5
    for bad in ("-1", "all", "1.5", -2, ""):
        with pytest.raises(ValueError, match="--keep-checkpoints .*0 to keep every step"):
            parse_keep(bad)
    assert keep_of(["--steps=5"]) == DEFAULT_KEEP == 3
    assert keep_of(["--keep-checkpoints=1", "--keep-checkpoints", "4"]) == 4
    assert describe_keep(3) == "the newest 3 complete steps kept"
    assert describe_keep(1) == "the newest 1 complete step kept"
    assert describe_keep(0) == "every step kept (--keep-checkpoints 0)"


def test_the_prune_line_names_what_went_what_stays_and_why() -> None:
    prune = choose_prune(_steps(10, 20, 30, 40, 50), complete={10, 20, 30, 40, 50}, keep=3)
    assert prune_message(job="J", removed=prune.remove, prune=prune, keep=3) == (
        "checkpoints: removed step 10, 20 of job J (keeping 30, 40, 50; --keep-checkpoints 3)"
    )
    pinned = choose_prune(_steps(5, 10, 20), complete={5, 10, 20}, keep=1, pinned={5})
    assert prune_message(job="J", removed=(10,), prune=pinned, keep=1, where=" on a, b") == (
        "checkpoints: removed step 10 of job J on a, b (keeping 5, 20; 5 pinned; "
        "--keep-checkpoints 1)"
    )


# --------------------------------------------------------------------- pins


PIN = Pin(step=40, holder="autohet recover (pid 7 on ctl)", machine="ctl", pid=7, expires_unix=100)


def test_a_pin_file_round_trips_and_its_name_says_its_step() -> None:
    name = pin_name(40, "a1b2")
    assert name == ".pin-step-00000040-a1b2.json" and parse_pin_name(name) == 40
    for other in ("step-00000040", ".pin-step-40-a.json", ".pin-step-00000040-a/b.json"):
        assert parse_pin_name(other) is None
    assert pin_from_text(pin_to_text(PIN), "p") == PIN
    with pytest.raises(ValueError, match="token"):
        pin_name(1, "")


def test_a_pin_holds_until_it_expires_or_its_writer_is_gone() -> None:
    assert pin_holds(PIN, now_unix=99.0, writer_gone=False)
    assert not pin_holds(PIN, now_unix=100.0, writer_gone=False)  # expired
    assert not pin_holds(PIN, now_unix=50.0, writer_gone=True)  # left by a dead process


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"schema": "autohet.pin/v1"}', "expected the keys"),
        (pin_to_text(PIN).replace("autohet.pin/v1", "x"), "schema"),
        (pin_to_text(PIN).replace('"pid": 7', '"pid": "7"'), "pid: expected int"),
        (pin_to_text(PIN).replace('"expires_unix": 100', '"expires_unix": true'), "expires_unix"),
    ],
)
def test_a_bad_pin_file_is_refused_naming_the_field(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        pin_from_text(text, "job/.pin-step-00000040-a.json")
