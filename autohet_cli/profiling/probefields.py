"""Reading the probe's result: typed fields, the device, the notes and the meta (pure).

Every failure names the host and the field (``ProfileError``), since a result
comes from a host's own torch and probe version. ``profiling.measure`` builds the
profile's entries from the runs; this module reads the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn

from autohet_cli.catalog import CATALOG, canonical_gpu_name
from autohet_cli.errors import ProfileError, UnknownNameError
from autohet_cli.estimates.profile import DeviceFacts
from autohet_cli.models import ModelSpec


class ProbeReader:
    """Typed access to the probe's JSON; every failure names the host and the field."""

    def __init__(self, host: str) -> None:
        self.host = host

    def fail(self, at: str, problem: str) -> NoReturn:
        raise ProfileError(f"probe result from {self.host}: {at}: {problem}")

    def mapping(self, obj: Any, at: str) -> Mapping[str, Any]:
        if not isinstance(obj, Mapping):
            self.fail(at, f"expected an object, got {type(obj).__name__}")
        return obj

    def items(self, obj: Any, at: str) -> list[Any]:
        if not isinstance(obj, list):
            self.fail(at, f"expected a list, got {type(obj).__name__}")
        return obj

    def get(self, d: Mapping[str, Any], key: str, at: str) -> Any:
        if key not in d:
            self.fail(f"{at}.{key}" if at else key, "missing")
        return d[key]

    def text(self, d: Mapping[str, Any], key: str, at: str) -> str:
        value = self.get(d, key, at)
        if not isinstance(value, str) or not value:
            self.fail(f"{at}.{key}" if at else key, f"expected a non-empty string, got {value!r}")
        return value

    def number(self, d: Mapping[str, Any], key: str, at: str, *, positive: bool = False) -> float:
        value = self.get(d, key, at)
        where = f"{at}.{key}" if at else key
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(where, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            self.fail(where, f"expected a finite {'positive' if positive else '>= 0'} number")
        return float(value)

    def integer(self, d: Mapping[str, Any], key: str, at: str, *, minimum: int = 0) -> int:
        value = self.get(d, key, at)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(f"{at}.{key}" if at else key, f"expected an integer >= {minimum}")
        return value


def device_facts(r: ProbeReader, doc: Mapping[str, Any], declared: str | None) -> DeviceFacts:
    dev = r.mapping(r.get(doc, "device", ""), "device")
    kind = r.text(dev, "type", "device")
    if kind == "cpu":
        gpu_type = _checked(r, declared, "cpu", "no GPU (it ran on the CPU)")
    elif kind == "cuda":
        name = r.text(dev, "name", "device")
        try:
            detected = canonical_gpu_name(name)
        except UnknownNameError as exc:
            if declared is None:
                r.fail("device.name", str(exc))
            detected = None
        gpu_type = _checked(r, declared, detected, f"{name!r} ({detected})")
    else:
        r.fail("device.type", f"expected cpu or cuda, got {kind!r}")
    matmul = r.mapping(r.get(doc, "matmul", ""), "matmul")
    bandwidth = r.mapping(r.get(doc, "mem_bandwidth", ""), "mem_bandwidth")
    return DeviceFacts(
        gpu_type=gpu_type,
        mem_bytes=r.integer(dev, "mem_bytes", "device", minimum=1),
        matmul_tflops=r.number(matmul, "tflops", "matmul", positive=True),
        mem_bandwidth_gbytes_s=r.number(bandwidth, "gbytes_s", "mem_bandwidth", positive=True),
        source="measured",
    )


def _checked(r: ProbeReader, declared: str | None, detected: str | None, found: str) -> str:
    """The type to file the measurement under: the declared one, unless the device
    is plainly another (a catalog type, or the CPU) and the numbers would lie."""
    if declared is None or declared == detected:
        assert detected is not None  # an unknown device without a declared type failed above
        return detected
    if detected is not None and (detected == "cpu" or declared == "cpu" or declared in CATALOG):
        r.fail(
            "device.name",
            f"the cluster file says gpus.type {declared} but the probe found {found}; "
            "fix the host's gpus.type, or the host's torch install if it should see a GPU",
        )
    return declared


def comm_notes(r: ProbeReader, doc: Mapping[str, Any]) -> list[str]:
    notes = []
    for tp, raw in sorted(r.mapping(doc.get("tp_comm") or {}, "tp_comm").items()):
        comm = r.mapping(raw, f"tp_comm.{tp}")
        method = r.text(comm, "method", f"tp_comm.{tp}")
        notes.append(f"tp {tp} all-reduces: {method}: {comm.get('note', '')}".rstrip(": "))
    dev = r.mapping(doc["device"], "device")
    if dev.get("type") == "cpu":
        notes.append(
            f"cpu device: {dev.get('threads')} thread(s) of {dev.get('cores')} core(s); "
            f"memory {dev.get('mem_note', 'as reported')}"
        )
    notes += [str(n) for n in r.items(doc.get("notes") or [], "notes")]
    return notes


def probe_meta(
    r: ProbeReader,
    doc: Mapping[str, Any],
    model: ModelSpec,
    host: str,
    device: DeviceFacts,
    notes: list[str],
) -> dict[str, Any]:
    facts = r.mapping(r.get(doc, "host", ""), "host")
    software = {k: facts.get(k) for k in ("python", "torch", "cuda", "driver")}
    r.text(facts, "torch", "host")
    created = doc.get("created_utc")
    if not isinstance(created, str) or not created:
        created = datetime.now(UTC).isoformat(timespec="seconds")
    version = str(r.get(doc, "probe_version", ""))
    dev = r.mapping(doc["device"], "device")
    matmul = r.mapping(doc["matmul"], "matmul")
    record = {
        "measure": "probe",
        "model": model.name,
        "host": host,
        "hostname": facts.get("hostname"),
        "gpu_type": device.gpu_type,
        "device_name": dev.get("name"),
        "dtype": doc.get("dtype"),  # every entry of this measurement is in it
        "created": created,
        "probe_version": version,
        "software": software,
        "matmul_n": matmul.get("n"),
        "notes": notes,
    }
    return {
        "source": "measured",
        "created": created,
        "hosts": [host],
        "software": software,
        "probe_version": version,
        "history": [record],
    }
