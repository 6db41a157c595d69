"""The run report: what every rank measured, gathered by rank 0 at the end of training.

Rank 0 writes ``RUN_DIR/report.json`` and prints it on one stdout line starting
with ``autohet-report: `` (the launcher reads it from the host's log, so no file
has to be fetched from a remote host), and, with ``--trace``, a Chrome trace of
the traced steps in the form ``autohet estimate --trace`` writes (``trace``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autohet_cli.runtime.hooks import Hook
from autohet_cli.runtime.metrics import peak_memory_bytes
from autohet_cli.runtime.trainer_api import TrainerView
from autohet_cli.trace import Span, chrome_trace
from autohet_cli.workerbase.records import REPORT_PREFIX

REPORT_SCHEMA = "autohet.run-report/v1"
TRACE_STEPS = 3  # steps traced with --trace, after two warm-up steps


class RunReportHook(Hook):
    def __init__(self, run_dir: Path | None, *, trace_path: Path | None = None) -> None:
        self.run_dir, self.trace_path = run_dir, trace_path

    def on_train_start(self, trainer: TrainerView) -> None:
        if self.trace_path is not None:
            first = min(trainer.step + 2, max(trainer.step, trainer.last_step - TRACE_STEPS))
            trainer.trace_steps = set(range(first, min(first + TRACE_STEPS, trainer.last_step)))

    def on_train_end(self, trainer: TrainerView) -> None:
        rt = trainer.runtime
        info = rt.info
        stage = rt.plan.pipelines[info.pipeline].stages[info.stage]
        mine = {
            "rank": rt.global_rank,
            "host": stage.devices[info.tp_rank].host,
            "pipeline": info.pipeline,
            "stage": info.stage,
            "tp_rank": info.tp_rank,
            "num_microbatches": info.num_microbatches,
            "device": rt.device.type,
            "peak_mem_bytes": peak_memory_bytes(rt.device),
            "medians": trainer.timings.medians(),
        }
        traced = [asdict(t) for t in trainer.timings.traced] if self.trace_path else []
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, traced))
        if rt.global_rank != 0:
            return
        plan = rt.plan
        report = {
            "schema": REPORT_SCHEMA,
            "plan": f"{plan.name}.v{plan.version}",
            "first_step": min((t.step for t in trainer.timings.summaries), default=trainer.step),
            "last_step": trainer.step,
            "ranks": sorted((g[0] for g in gathered), key=lambda r: r["rank"]),
        }
        text = json.dumps(report, separators=(",", ":"))
        if self.run_dir is not None:
            _write(self.run_dir / "report.json", json.dumps(report, indent=1))
        print(REPORT_PREFIX + text, flush=True)
        if self.trace_path is not None:
            trace = chrome_trace(
                measured_spans([(g[0], g[1]) for g in gathered]),
                title=f"measured: {plan.name}.v{plan.version}",
            )
            _write(self.trace_path, json.dumps(trace))


def measured_spans(ranks: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[Span]:
    """Each stage's TP rank 0, its traced steps laid one after the other (each step
    starts where the slowest rank's previous traced step ended)."""
    steps = sorted({t["step"] for _, traced in ranks for t in traced})
    offset, offsets = 0.0, {}
    for step in steps:
        offsets[step] = offset
        offset += max(t["step_ms"] for _, traced in ranks for t in traced if t["step"] == step)
    out = []
    for info, traced in ranks:
        if info["tp_rank"] != 0:
            continue
        for t in traced:
            base = offsets[t["step"]]
            for op in t["ops"]:
                out.append(
                    Span(
                        pipeline=info["pipeline"],
                        stage=info["stage"],
                        name=op["name"],
                        start_ms=base + op["start_ms"],
                        end_ms=base + op["end_ms"],
                        step=t["step"],
                    )
                )
    return out


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
