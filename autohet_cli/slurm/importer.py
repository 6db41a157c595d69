"""A cluster file from Slurm's own description of its nodes (pure).

``autohet cluster import --slurm`` runs ``scontrol show node -o`` (one line per
node) and hands the text here. Each node with GPU GRES (``gpu:a100:4``, also
``gpu:a100:4(S:0-1)`` and several types on one node) becomes a host named after
the node, at its ``NodeAddr``, with the GRES type mapped to a GPU type of the
catalog (``--gpu-type a100=A100-80`` where the name alone does not say which).
The ``slurm:`` section gets, per GPU type, the GRES type to request. Nodes
without GPUs are left out, or taken as ``cpu`` hosts with ``cpu_devices``
workers each (CPU-only test clusters). The result goes through the cluster
schema before anyone writes it, so an import never produces a file that
``autohet plan`` would refuse.

``NodeAddr`` is what slurmctld connects to, written by an administrator (or a
node registering itself), and autohet hands it to ssh: it must be a host name
or an IP address (``names.check_address``), or ``-oProxyCommand=...`` would be
an ssh option. An address that means "this machine" depends on whose machine:

* ``localhost`` (or ``local``) makes a host *local*: its commands run here,
  without SSH, and its checkpoints are read from this machine's disks. To
  slurmctld it means the controller's own machine, which is not where
  ``cluster import`` runs unless this is that node (a one-machine Slurm). So it
  is taken only when the node's name (or NodeHostName) is this machine's, and
  refused otherwise: a login node would silently stand in for the GPU node.
* a loopback IP (``127.x``, ``::1``) stays an SSH address that reaches this
  machine; right for test clusters whose node daemons all run here, so it is
  kept, with a note saying so.

``scontrol`` output is decoded with undecodable bytes replaced (``ctl.run``):
such a byte in a field autohet uses (a node name, an address) is refused by
name; anywhere else (a Reason typed in Latin-1) it does no harm.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autohet_cli.cluster import LOCAL_ADDRESSES, SCHEMA, cluster_from_dict
from autohet_cli.errors import ConfigError, UnknownNameError
from autohet_cli.gputypes import resolve_gpu_type
from autohet_cli.names import check_address, check_host_name
from autohet_cli.slurm.ctl import parse_fields

_GRES = re.compile(r"gpu(?::([A-Za-z0-9_.-]+))?:(\d+)")
# Node states whose node cannot run a job now (reported, still imported).
_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "INVAL", "FUTURE")


@dataclass(frozen=True, slots=True, kw_only=True)
class Imported:
    doc: dict[str, Any]  # the cluster file, as a mapping (validated)
    notes: tuple[str, ...] = field(default=())  # what was left out or assumed


def gpu_gres(gres: str) -> list[tuple[str | None, int]]:
    """``gpu:a100:4(S:0-1),nic:1`` -> ``[("a100", 4)]``; untyped ``gpu:2`` -> ``[(None, 2)]``."""
    out = []
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        m = _GRES.fullmatch(item.strip())
        if m and int(m.group(2)) > 0:
            out.append((m.group(1), int(m.group(2))))
    return out


def import_nodes(
    text: str,
    *,
    name: str,
    partition: str | None = None,
    gpu_types: Mapping[str, str] | None = None,
    cpu_devices: int = 0,
    this_host: str | None = None,
) -> Imported:
    """The cluster file for the nodes of ``text`` (``scontrol show node -o``).

    ``this_host``: this machine's host name (``socket.gethostname()``), which a node
    whose NodeAddr is ``localhost`` must have; None (unknown) refuses such nodes."""
    given = dict(gpu_types or {})
    hosts: list[dict[str, Any]] = []
    gres_of: dict[str, str | None] = {}  # GPU type -> GRES type to request
    notes: list[str] = []
    unknown: dict[str, list[str]] = {}
    for line in text.splitlines():
        f = parse_fields(line.strip())
        node = f.get("NodeName")
        if not node:
            continue
        parts = [p.rstrip("*") for p in f.get("Partitions", "").split(",") if p]
        if partition is not None and partition not in parts:
            continue
        _check_utf8(node, "NodeName", node)
        check_host_name(node, f"scontrol show node: NodeName {node!r}")
        state = f.get("State", "")
        if any(s in state for s in _UNUSABLE):
            notes.append(f"{node}: state {state}; imported, but Slurm will not start jobs on it")
        gres = gpu_gres(f.get("Gres", ""))
        address = node_address(f, this_host, notes)
        if len(gres) > 1:
            notes.append(
                f"{node}: several GPU types ({f.get('Gres')}); imported with the first, "
                f"{gres[0][0]}: a host has one GPU type"
            )
        if not gres:
            if cpu_devices:
                hosts.append(_host(node, address, "cpu", cpu_devices))
            else:
                notes.append(f"{node}: no GPU GRES; left out (--cpu-devices N takes it as cpu)")
            continue
        gres_type, count = gres[0]
        label = gres_type or "(untyped)"
        wanted = given.get(label) or given.get(gres_type or "")
        try:
            gpu_type = resolve_gpu_type(wanted or (gres_type or ""), {})
        except UnknownNameError:
            unknown.setdefault(label, []).append(node)
            continue
        if wanted is None and gpu_type.lower() != (gres_type or "").lower():
            notes.append(
                f"GRES type {gres_type} taken as {gpu_type}; if yours differ (memory), "
                f"pass --gpu-type {gres_type}=TYPE"
            )
        previous = gres_of.setdefault(gpu_type, gres_type)
        if previous != gres_type:
            notes.append(
                f"{gpu_type}: GRES types {previous} and {gres_type} both map to it; "
                f"jobs request {previous}"
            )
        hosts.append(_host(node, address, gpu_type, count))
    if unknown:
        listed = "; ".join(f"{g} on {', '.join(ns)}" for g, ns in sorted(unknown.items()))
        raise ConfigError(
            f"scontrol show node: GPU GRES types autohet does not know: {listed}. Name each "
            "one's GPU type with --gpu-type GRES=TYPE (e.g. --gpu-type a100=A100-80; "
            "`autohet models gpus` lists the types), or define it under gpu_types: in the file"
        )
    if not hosts:
        where = f" in partition {partition}" if partition else ""
        raise ConfigError(
            f"scontrol show node: no node with GPUs{where}"
            + ("; pass --cpu-devices N to take CPU-only nodes" if not cpu_devices else "")
        )
    slurm: dict[str, Any] = {}
    if partition:
        slurm["partition"] = partition
    typed = {t: {"gres": g} for t, g in gres_of.items() if g}
    if typed:
        slurm["gpu_types"] = typed
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "name": name,
        "backend": "slurm",
        "slurm": slurm,
        "hosts": hosts,
        "notes": f"imported from Slurm (scontrol show node){' ' + partition if partition else ''}",
    }
    cluster_from_dict(doc, "the imported cluster")  # the schema's own checks
    return Imported(doc=doc, notes=tuple(dict.fromkeys(notes)))


def node_address(f: Mapping[str, str], this_host: str | None, notes: list[str]) -> str:
    """The address of a node's ``scontrol`` fields, checked (see the module's notes)."""
    node = f["NodeName"]
    address = f.get("NodeAddr") or node
    _check_utf8(address, "NodeAddr", node)
    check_address(address, f"scontrol show node: node {node}: NodeAddr")
    if address.lower() in LOCAL_ADDRESSES:
        names = {n.lower() for n in (node, f.get("NodeHostName", "")) if n}
        mine = {this_host.lower(), this_host.lower().split(".")[0]} if this_host else set()
        if not names & mine:
            raise ConfigError(
                f"scontrol show node: node {node}: NodeAddr {address!r} would make it this "
                f"machine ({this_host or 'unknown'}), where autohet runs commands without SSH; "
                f"slurmctld means its own machine by it. Run `autohet cluster import` on "
                f"{node}, or write {node}'s real address into the file by hand"
            )
        notes.append(f"{node}: NodeAddr {address}: taken as this machine (no SSH)")
    elif _is_loopback(address):
        notes.append(
            f"{node}: NodeAddr {address} is a loopback address: autohet reaches it over SSH "
            "on this machine, which is right only where the node runs here"
        )
    return address


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _check_utf8(value: str, key: str, node: str) -> None:
    if "\ufffd" in value:
        raise ConfigError(
            f"scontrol show node: {key} {value!r} (node {node!r}) is not UTF-8 text "
            "(\ufffd marks the bytes that are not); name the node in UTF-8 in slurm.conf"
        )


def _host(node: str, address: str, gpu_type: str, count: int) -> dict[str, Any]:
    return {"name": node, "address": address, "gpus": {"type": gpu_type, "count": count}}
