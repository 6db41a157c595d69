"""Imports run one way (docs/architecture.md): read from the code itself, every import
statement at any level (function bodies and TYPE_CHECKING blocks included: an arrow
is an arrow), resolved to the project's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2] / "autohet_cli"

# The pure core: what the planner and the artifacts stand on. It imports nothing that
# reaches hosts, runs workers or prints for a command.
CORE = {
    "architecture", "catalog", "cluster", "costmodel", "errors", "estimates", "gputypes",
    "hfconfig", "hffamilies", "layerspec", "limits", "models", "modelspec", "names", "plan",
    "planner", "preemption", "settings", "slurmconf", "yamlio", "yamlcache", "regular_file",
    "privatedir", "paths", "inputs", "defaults", "runconfig", "tomlio", "trace", "oom", "pids",
}  # fmt: skip
EFFECTS = {"cli", "launch", "recovery", "slurm", "profiling", "transport", "runtime", "ckpt"}
# The workers' side, top to bottom (docs/architecture.md): runtime over runfiles over
# ckpt over peer over workerbase; dataset beside them.
WORKER_ORDER = ("runtime", "runfiles", "ckpt", "peer", "workerbase")


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _graph() -> nx.DiGraph:
    mods = _modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("autohet_cli"):
                    graph.add_edge(name, target)
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


GRAPH = _graph()


def test_no_module_imports_itself_back_through_others() -> None:
    circles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert circles == [], circles


def test_the_pure_core_imports_nothing_above_it() -> None:
    up = sorted(
        f"{a} -> {b}"
        for a, b in GRAPH.edges
        if _top(a) in CORE and _top(b) in EFFECTS | {*WORKER_ORDER, "dataset"}
    )
    assert up == [], up


def test_packages_form_no_circle() -> None:
    packages = nx.DiGraph((_top(a), _top(b)) for a, b in GRAPH.edges if _top(a) != _top(b))
    circles = [sorted(c) for c in nx.strongly_connected_components(packages) if len(c) > 1]
    assert circles == [], circles


def test_worker_packages_only_import_down() -> None:
    """A worker package imports only the ones below it in ``WORKER_ORDER``."""
    rank = {p: i for i, p in enumerate(WORKER_ORDER)}
    up = sorted(
        f"{a} -> {b}"
        for a, b in GRAPH.edges
        if _top(a) in rank and _top(b) in rank and rank[_top(b)] < rank[_top(a)]
    )
    assert up == [], up


def test_sessions_drive_a_backend_and_never_import_one_by_name() -> None:
    """launch.session and recovery.session reach hosts through ``launch.backend``; a
    backend (ssh, slurm) imports the launch's shared pieces, never the session."""
    for session in ("autohet_cli.launch.session", "autohet_cli.recovery.session"):
        named = [
            b
            for b in nx.descendants(GRAPH, session)
            if b.startswith("autohet_cli.slurm.") or b == "autohet_cli.launch.ssh_backend"
        ]
        assert named == [], (session, named)
    for backend in ("autohet_cli.launch.ssh_backend", "autohet_cli.slurm.backend"):
        assert "autohet_cli.launch.session" not in nx.descendants(GRAPH, backend), backend


def test_the_registry_knows_both_backends_and_takes_a_third() -> None:
    from autohet_cli.errors import ConfigError
    from autohet_cli.launch import backend
    from autohet_cli.slurmconf import BACKENDS, backend_from

    assert backend.backend_for("ssh").name == "ssh"
    assert backend.backend_for("slurm").name == "slurm"
    try:
        backend.register("k8s", "autohet_cli.launch.ssh_backend")  # any module with BACKEND
        assert backend_from("k8s", "backend") == "k8s" and backend.backend_for("k8s")
    finally:
        backend.MODULES.pop("k8s", None)
        backend._LOADED.pop("k8s", None)
        if "k8s" in BACKENDS:
            BACKENDS.remove("k8s")
    try:
        backend.backend_for("nosuch")
    except ConfigError as exc:
        assert "backend 'nosuch': not one of slurm, ssh" in str(exc)
    else:
        raise AssertionError("an unknown backend was accepted")
