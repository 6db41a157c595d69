"""Run config files: strict schema, flags override the file, the worker reads them too."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from autohet_cli.cli.trainopts import resolve
from autohet_cli.errors import ConfigError
from autohet_cli.runconfig import SETTINGS, load_run_config, worker_args
from autohet_cli.runtime.train import parse_args, train_config


def _write(tmp: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def test_yaml_and_toml_give_the_same_settings(tmp_path: Path) -> None:
    y = _write(
        tmp_path, "steps: 50\nlr: 3e-4\nwarmup_steps: 10\ndata: /d/tok\ncheckpoint_every: 5\n"
    )
    t = _write(
        tmp_path,
        'steps = 50\nlr = 3e-4\nwarmup_steps = 10\ndata = "/d/tok"\ncheckpoint_every = 5\n',
        "run.toml",
    )
    want = {"steps": 50, "lr": 3e-4, "warmup_steps": 10, "data": "/d/tok", "checkpoint_every": "5"}
    assert load_run_config(y) == want
    assert load_run_config(t) == want


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr_shedule: cosine\n", "unknown setting 'lr_shedule' (did you mean 'lr_schedule'?)"),
        ("lr: fast\n", "lr: expected float"),
        ("steps: 1.5\n", "steps: expected int"),
        ("grad_clip: -1\n", "grad_clip: must be at least 0"),
        ("lr_schedule: step\n", "lr_schedule: expected one of cosine, linear, constant"),
        ("eval_every: true\n", "eval_every: expected int"),
        ("- lr\n", "expected a mapping"),
        ("schema: autohet.run/v9\n", "schema: expected 'autohet.run/v1'"),
        ("lr: [\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_run_config(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such run config file"):
        load_run_config(tmp_path / "nope.yaml")


def test_every_setting_is_a_worker_flag() -> None:
    """Each key becomes a flag the worker parses to the same value."""
    values = {
        "steps": 7,
        "seed": 3,
        "lr": 0.002,
        "min_lr": 0.0002,
        "warmup_steps": 2,
        "decay_steps": 6,
        "lr_schedule": "linear",
        "lr_extend": "rewarm",
        "weight_decay": 0.05,
        "beta1": 0.8,
        "beta2": 0.9,
        "grad_clip": 0.5,
        "max_nonfinite_steps": 5,
        "data": "/d/tok",
        "data_dtype": "uint32",
        "data_fn": "m:f",
        "val_fraction": 0.01,
        "eval_every": 3,
        "eval_batches": 2,
        "model_fn": "m:g",
        "init_from": "/hf",
        "checkpoint_every": "4",
        "keep_checkpoints": 2,
        "replicas": 2,
        "replica_budget": "20GB",
    }
    assert set(values) == {s.key for s in SETTINGS}
    args = parse_args(["--plan", "p.yaml", *worker_args(values)])
    for key, value in values.items():
        got = getattr(args, key)
        want = {"checkpoint_every": 4, "replica_budget": 20 * 10**9}.get(key, value)
        assert got == want, key


def test_the_worker_reads_the_file_and_its_flags_override(tmp_path: Path) -> None:
    path = _write(tmp_path, "steps: 9\nlr: 0.01\nwarmup_steps: 3\n")
    args = parse_args(["--plan", "p.yaml", "--config", str(path), "--lr", "0.02"])
    assert (args.steps, args.lr, args.warmup_steps) == (9, 0.02, 3)
    config = train_config(args)
    assert config.lr == 0.02 and config.warmup_steps == 3 and config.grad_clip == 1.0


def test_the_worker_refuses_a_bad_file_like_a_bad_flag(tmp_path: Path) -> None:
    path = _write(tmp_path, "lr: -1\n")
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.yaml", "--steps", "1", "--config", str(path)])


def test_launch_options_override_the_file_and_train_args_override_both(tmp_path: Path) -> None:
    path = _write(tmp_path, "steps: 40\ncheckpoint_every: 10\ndata: /a\nlr: 0.1\n")
    t = resolve(
        config=path,
        steps=None,
        checkpoint_every=None,
        data="/b",
        data_fn=None,
        train_arg=["--lr=0.3"],
    )
    assert (t.steps, t.checkpoint_every) == (40, "10")
    args = parse_args(["--plan", "p", f"--steps={t.steps}", *t.train_args])
    assert args.data == "/b" and args.lr == 0.3
    t2 = resolve(
        config=path, steps=5, checkpoint_every="0", data=None, data_fn=None, train_arg=None
    )
    assert (t2.steps, t2.checkpoint_every) == (5, "0")
    t3 = resolve(
        config=None, steps=None, checkpoint_every=None, data=None, data_fn=None, train_arg=None
    )
    assert (t3.steps, t3.checkpoint_every, t3.train_args) == (100, "auto", ())
    with pytest.raises(ConfigError):
        resolve(config=None, steps=1, checkpoint_every="x", data=None, data_fn=None, train_arg=None)


# --------------------------------------------------------------------- data on resume


def test_a_checkpoint_of_other_data_is_refused(alone: None, tmp_path: Path) -> None:
    from test_runtime_trainer import PLAN

    from autohet_cli.runtime.trainer import TrainConfig, Trainer

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.save(tmp_path / f"{name}.npy", rng.integers(0, 250, 20_000).astype(np.uint16))
    first = Trainer(PLAN, TrainConfig(device="cpu", data=str(tmp_path / "a.npy")))
    first.fit(1)
    state = copy.deepcopy(first.state_dict())
    first.close()
    same = Trainer(PLAN, TrainConfig(device="cpu", data=str(tmp_path / "a.npy")))
    same.load_state_dict(state)  # the same data: fine
    assert same.step == 1
    same.close()
    other = Trainer(PLAN, TrainConfig(device="cpu", data=str(tmp_path / "b.npy")))
    with pytest.raises(ConfigError, match="trained on other data"):
        other.load_state_dict(state)
    other.close()


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="lr: must be a finite number"):
        load_run_config(_write(tmp_path, f"lr: {value}\n"))
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p", "--steps", "1", "--lr", "nan"])
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p", "--steps", "1", "--grad-clip", "-1"])


# ------------------------------------------ hostile run configs (issue 29, Medium 6, 10)


def _alias_levels(levels: int) -> str:
    """``data:`` holding anchored lists of nine aliases of the level before: 9^levels
    strings once expanded (the "billion laughs" at ``levels`` 9)."""
    parts = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"data: [{', '.join(parts)}]\n"


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_run_config(path)
    message = str(exc.value)
    assert str(path) in message and "\n" not in message and len(message) < 600, message[:2000]
    return message


def test_an_alias_bomb_is_refused_without_expanding_it(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, _alias_levels(6)))  # 531,441 strings
    assert "aliases expand to more than" in message


def test_a_value_shown_in_an_error_is_cut_short(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, _alias_levels(4)))  # 6,561 strings: allowed
    assert "data: expected str" in message and "..." in message
    assert "unknown setting" in _error(_write(tmp_path, "? " + "x" * 100_000 + "\n: 1\n"))
    assert "schema: expected" in _error(_write(tmp_path, f"schema: {'v' * 100_000}\n"))


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("run.yaml", "data: " + "[" * 100_000 + "\n"),
        ("run.yaml", "data: " + "{a: " * 100_000 + "\n"),
        ("run.toml", "data = " + "[" * 100_000 + "\n"),
        ("run.toml", "data = " + "{a = " * 100_000 + "\n"),
        ("run.toml", "a" + ".a" * 3_000 + " = 1\n"),
        ("run.toml", "[a" + ".a" * 3_000 + "]\n"),
        ("run.toml", "data = [" + "[" * 70 + "]" * 71 + "\n"),
    ],
)
def test_deep_nesting_is_one_clear_error(tmp_path: Path, name: str, text: str) -> None:
    assert "nested more than 64 levels" in _error(_write(tmp_path, text, name))


def test_toml_strings_and_comments_do_not_count_as_nesting(tmp_path: Path) -> None:
    text = (
        'data = "/d/[[[[{{{{' + "." * 200 + '"  # ' + "[{." * 100 + "\n"
        "data_fn = '''m.a.b.c.d:" + "." * 100 + "'''\n"
        'model_fn = """x\n' + "[" * 100 + '"""\n'
        "lr = 3.0e-4\n"
    )
    got = load_run_config(_write(tmp_path, text, "run.toml"))
    assert (
        got["lr"] == 3.0e-4 and got["data"].startswith("/d/[[[[") and "[" * 100 in got["model_fn"]
    )


def test_a_run_config_past_one_mib_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "# comment\n" * 200_000 + "steps: 5\n")
    assert "larger than 1 MiB" in _error(path)


@pytest.mark.parametrize("name", ["run.yaml", "run.toml"])
@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("steps", 10**23, "steps: 1e+23 is larger than 1,000,000,000,000"),
        ("warmup_steps", 10**13, "warmup_steps: 10000000000000 is larger than"),
        ("eval_every", 10**400, "eval_every: 1e+400 is larger than"),
        ("seed", 10**19, "seed: 1e+19 is larger than"),
        ("keep_checkpoints", -(10**30), "keep_checkpoints: must be at least 0, got -1e+30"),
    ],
    ids=["steps", "warmup", "eval_every", "seed", "keep"],
)
def test_integers_are_bounded_and_shown_short(
    tmp_path: Path, name: str, key: str, value: int, needle: str
) -> None:
    sep = " = " if name.endswith(".toml") else ": "
    message = _error(_write(tmp_path, f"{key}{sep}{value}\n", name))
    assert needle in message, message


def test_steps_on_the_command_line_are_bounded_too() -> None:
    with pytest.raises(ConfigError, match=r"--steps: 1e\+23 is larger than 1,000,000,000,000"):
        resolve(
            config=None,
            steps=10**23,
            checkpoint_every=None,
            data=None,
            data_fn=None,
            train_arg=None,
        )
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p.yaml", "--steps", str(10**23)])
    assert parse_args(["--plan", "p.yaml", "--steps", str(10**12)]).steps == 10**12


def test_a_named_pipe_as_config_is_refused_at_once(tmp_path: Path) -> None:
    """``open()`` on a FIFO waits for a writer forever: --config, a plan or a cluster
    file naming one hung the command (issue 29)."""
    import os

    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"run\.yaml: is a named pipe \(FIFO\), not a regular"):
        load_run_config(fifo)


def test_the_workers_help_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """A '%' in a help string (the auto schedule's "2%") crashed ``--help``, which the
    launcher's root cause for a refused flag points users to."""
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "under 2% of the time" in out and "--max-nonfinite-steps N" in out
