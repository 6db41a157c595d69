"""What this host is: its facts, its accelerators, the device and dtype the probe uses.

Every result starts with these, so that autohet can check the device against the
cluster file's GPU type and record the software the numbers came from. GPUs are
listed by torch and, when present, by nvidia-smi (driver and topology); without
a GPU the CPU is one device of type ``cpu`` with min(RAM/2, 8 GiB), so that a CPU
host is never timed into swap.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import subprocess
from typing import Any

import torch

from .spec import SpecError

GIB = 1 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def nvidia_smi() -> dict[str, Any] | None:
    out = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader,nounits",
        ]
    )
    if out is None:
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        index, name, mem_mib, driver = parts
        with contextlib.suppress(ValueError):
            gpus.append(
                {
                    "index": int(index),
                    "name": name,
                    "mem_bytes": int(float(mem_mib)) << 20,
                    "driver": driver,
                }
            )
    return {"gpus": gpus, "topology": _run(["nvidia-smi", "topo", "-m"])}


def host_facts(smi: dict[str, Any] | None) -> dict[str, Any]:
    driver = smi["gpus"][0]["driver"] if smi and smi["gpus"] else None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "ram_bytes": _ram_bytes(),
    }


def gpu_inventory() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "mem_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return gpus


def pick_device(spec: dict[str, Any], gpus: list[dict[str, Any]]) -> torch.device:
    wanted = spec["device"]
    if wanted == "auto":
        return torch.device("cuda", 0) if gpus else torch.device("cpu")
    dev = torch.device(wanted)
    if dev.type == "cuda" and (dev.index or 0) >= len(gpus):
        raise SpecError(f"spec.device: {wanted!r} but this host has {len(gpus)} GPU(s)")
    return dev if dev.type == "cpu" or dev.index is not None else torch.device("cuda", 0)


def pick_dtype(spec: dict[str, Any], dev: torch.device) -> str:
    if spec["dtype"] != "auto":
        return str(spec["dtype"])
    if dev.type == "cpu":
        return "fp32"
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4
        native = torch.cuda.get_device_capability(dev)[0] >= 8
    return "bf16" if native else "fp16"


def device_facts(dev: torch.device, gpus: list[dict[str, Any]], ram: int | None) -> dict[str, Any]:
    threads = torch.get_num_threads()
    if dev.type == "cuda":
        gpu = gpus[dev.index or 0]
        return {
            "type": "cuda",
            "index": gpu["index"],
            "name": gpu["name"],
            "mem_bytes": gpu["mem_bytes"],
            "cores": None,
            "threads": threads,
        }
    mem = min((ram or 16 * GIB) // 2, 8 * GIB)
    return {
        "type": "cpu",
        "index": None,
        "name": "cpu",
        "model": _cpu_name(),
        "mem_bytes": mem,
        "cores": _usable_cores(),
        "threads": threads,
        "mem_note": "min(RAM/2, 8 GiB)",
    }
