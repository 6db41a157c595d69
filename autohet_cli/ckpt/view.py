"""What the checkpoint helpers see of the checkpointer, and what it sees of the trainer.

The checkpointer (``ckpt.checkpointer``) sits at the top of this package: it drives
the helpers below it (``jobdir``, ``loading``, ``finish``, ``failures``) and hands
them itself. Were they to import its class to name that argument's type, each of
them would point back up at the module that calls it, and the package would be one
circle that can only be read, changed or tested as a whole. So each helper types the
argument against a ``typing.Protocol``: ``JobView`` here (the job and the ranks
saving it, which every helper reads), extended in the helper itself with exactly the
further members it uses. The real ``Checkpointer`` satisfies them structurally, and
mypy checks that wherever it passes itself down.

The trainer is the runtime's, and the runtime sits above ckpt (it builds the
checkpointer): ``CheckpointedTrainer`` lists what a checkpoint reads of it, so ckpt
never imports the runtime's trainer. Members only read are properties, so any object
exposing them (a dataclass field, a plain attribute) fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["JobView", "CheckpointedTrainer"]


class _Host(Protocol):
    @property
    def host(self) -> str: ...


class _RankInfo(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def device(self) -> _Host: ...


class _Topology(Protocol):
    def writes_layout(self, rank: int, layers: Iterable[int]) -> bool: ...


class _Runtime(Protocol):
    @property
    def info(self) -> _RankInfo: ...

    @property
    def topology(self) -> _Topology: ...


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Parts(Protocol):
    @property
    def tied(self) -> Sequence[Sequence[str]]: ...


class CheckpointedTrainer(Protocol):
    """The trainer as a checkpoint uses it: its plan's name (the job directory), this
    rank's host and which layers it writes (``runtime``), the tied parameter groups
    (``parts.tied``: one name per entry in every plan), the step, and its state.

    ``lineage``, ``check_same_model`` and ``optimizer`` are read with ``getattr``
    where a trainer may lack them (``ckpt.finish``, ``ckpt.loading``), so they are
    not required here."""

    @property
    def plan(self) -> _Named: ...

    @property
    def runtime(self) -> _Runtime: ...

    @property
    def parts(self) -> _Parts: ...

    @property
    def step(self) -> int: ...

    def state_dict(
        self, *, flat_optimizer: bool = False, template: bool = False
    ) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class JobView(Protocol):
    """The job and this rank's place among the ranks saving it: what every helper of
    the checkpointer reads. ``owner``: the lowest rank writing to this directory (one
    machine, one path), the one that changes it; ``group``: the process group of the
    checkpoint's collectives (``agree_no_problem`` uses it unless given another)."""

    plan_dir: Path
    job: str
    key: bytes
    host: str
    rank: int
    world_size: int
    owner: bool
    group: Any

    def agree_no_problem(self, problem: str | None, *, group: Any = None) -> None: ...
