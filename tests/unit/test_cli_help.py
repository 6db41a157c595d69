"""Every command's --help reads well in an 80-column terminal or a pipe.

Rendered through the real app at COLUMNS=80 (what a pipe gets too), each help
must show every option's name whole, cut nothing with an ellipsis, pair no
``--no-x`` flag with ``--no-no-x``, keep prose paragraphs filled (no line broken
mid-sentence) and carry at least one example, and every example must parse as
a command line of this very CLI (so the typical flow can be run as printed).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autohet_cli.cli import app as app_module

WIDTH = 78  # click's help width at COLUMNS=80
SECTIONS = ("Arguments:", "Options:", "Commands:")


# Commands and groups are duck-typed: typer vendors its own click in newer releases.
def _is_group(cmd: Any) -> bool:
    return hasattr(cmd, "commands")


def _root() -> Any:
    if not app_module.app.registered_commands:
        app_module._register()
    root = typer.main.get_command(app_module.app)
    assert _is_group(root)
    return root


def _paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, cmd in group.commands.items():
        if _is_group(cmd):
            out += _paths(cmd, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def _command(path: tuple[str, ...]) -> Any:
    cmd = _root()
    for name in path:
        cmd = cmd.commands[name]
    return cmd


PATHS = _paths(_root())


def _help(path: tuple[str, ...], columns: str = "80") -> str:
    result = CliRunner().invoke(app_module.app, [*path, "--help"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    return result.output


def _examples(text: str) -> list[list[str]]:
    """Example lines (verbatim blocks start ``autohet`` one indent deeper than prose),
    joined over trailing backslashes."""
    lines, out, pending = text.splitlines(), [], ""
    for line in lines:
        stripped = line.strip()
        if pending:
            pending += " " + stripped
        elif line.startswith("    autohet "):  # a verbatim (\\b) block, not prose
            pending = stripped
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out.append(shlex.split(pending, comments=True))
        pending = ""
    return out


def test_the_walk_covers_every_command() -> None:
    names = {" ".join(p) for p in PATHS}
    assert {"plan", "estimate", "launch", "recover", "profile run", "models show"} <= names


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "autohet")
def test_help_at_80_columns_is_whole_and_has_an_example(path: tuple[str, ...]) -> None:
    text = _help(path)
    assert "…" not in text, text
    assert "--no-no-" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    cmd = _command(path)
    for param in cmd.params:
        if param.param_type_name == "option" and not param.hidden:
            for opt in [*param.opts, *param.secondary_opts]:
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), (opt, text)
    commands = text.split("Commands:")[1] if "Commands:" in text else ""
    assert not re.search(r"\.\.\.\s*$", commands, re.MULTILINE), commands
    examples = [e for e in _examples(text) if e[1 : 1 + len(path)] == list(path)]
    if not _is_group(cmd) or not path:
        assert examples, f"no example of autohet {' '.join(path)} in:\n{text}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "autohet")
def test_prose_is_filled_not_broken_mid_sentence(path: tuple[str, ...]) -> None:
    """Within a paragraph, a line ends only where the next word would not fit.

    Whatever draws the help (click, rich panels), the text before the first
    section is compared line by line; lines indented deeper than the prose are
    verbatim examples and may be short."""
    text = _help(path)
    head = re.split(r"^.*\b(?:Arguments|Options|Commands)\b.*$", text, flags=re.MULTILINE)[0]
    lines = [ln.rstrip().rstrip("│").rstrip() for ln in head.splitlines()[1:]]  # no Usage
    body = [ln.lstrip("│").rstrip() for ln in lines]
    indent = min(len(ln) - len(ln.lstrip()) for ln in body if ln.strip())
    for a, b in zip(body, body[1:], strict=False):
        if not a.strip() or not b.strip():
            continue  # a blank line ends a paragraph
        if len(a) - len(a.lstrip()) > indent or len(b) - len(b.lstrip()) > indent:
            continue
        assert len(a) + 1 + len(b.split()[0]) > WIDTH, f"broken line:\n{a}\n{b}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "autohet")
def test_every_example_is_a_valid_command_line(path: tuple[str, ...]) -> None:
    for argv in _examples(_help(path)):
        assert argv[0] == "autohet", argv
        cmd, args, names = _root(), argv[1:], []
        while _is_group(cmd) and args and args[0] in cmd.commands:
            names.append(args[0])
            cmd = cmd.commands[args.pop(0)]
        assert not _is_group(cmd), f"{argv} names no command"
        try:
            cmd.make_context(" ".join(["autohet", *names]), list(args))
        except Exception as exc:  # click's usage errors (typer may vendor click)
            if not hasattr(exc, "format_message"):
                raise
            pytest.fail(f"example does not parse: {shlex.join(argv)}: {exc.format_message()}")


def test_top_level_typical_flow_runs_as_printed() -> None:
    flow = [" ".join(argv[1:3]) for argv in _examples(_help(()))]
    assert flow[:2] == ["profile run", "plan --cluster"]
    profile_run = _examples(_help(()))[0]
    assert "--model" in profile_run


def test_help_is_the_same_when_wider() -> None:
    """A wide terminal only unwraps text; nothing appears that 80 columns hid."""
    narrow, wide = _help(("plan",)), _help(("plan",), columns="200")
    assert set(narrow.split()) == set(wide.split())


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "autohet")
def test_every_flag_is_lowercase_kebab_case(path: tuple[str, ...]) -> None:
    """Flags are what users type and scripts pin: ``--global-batch-size``, never
    ``--GLOBAL-BATCH-SIZE`` (typer 0.27 named an option after its metavar)."""
    cmd = _command(path)
    for param in getattr(cmd, "params", []):
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("-"):
                assert re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*|-[a-z]", flag), (path, flag)


def test_options_with_a_metavar_name_their_flag() -> None:
    """Typer 0.27 (in the CUDA images users run) turns ``typer.Option(metavar="MODEL")``
    into a flag ``--MODEL``, so ``--model`` is refused there. Naming the flag
    (``typer.Option("--model", metavar="MODEL")``) reads the same on every typer."""
    import ast
    from pathlib import Path

    import autohet_cli

    unnamed = []
    for file in Path(autohet_cli.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "Option" or not any(k.arg == "metavar" for k in node.keywords):
                continue
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and str(first.value).startswith("-")):
                unnamed.append(f"{file.name}:{node.lineno}")
    assert not unnamed, f"name the flag of these options: {unnamed}"


def test_a_command_imports_only_its_own_module() -> None:
    """``autohet plan`` starts without importing launch's SSH stack or data's numpy
    tokenizer path (half a second of every plan), and still runs as a subcommand."""
    import subprocess
    import sys

    code = (
        "import sys; sys.argv = ['autohet', 'plan', '--help']\n"
        "from autohet_cli.cli import app\n"
        "try:\n    app.main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', 'paramiko' in sys.modules, 'autohet_cli.cli.launch' in sys.modules,"
        " 'autohet_cli.cli.data' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Usage: autohet plan" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "LOADED False False False"
