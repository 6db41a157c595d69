"""HuggingFace weights in: ``--init-from DIR`` fills this rank's layers and TP shards.

``DIR`` is a HuggingFace model directory: ``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``. The config must describe the
plan's architecture. Each rank reads, through safetensors' ``get_slice``, only
the rows and columns of its own parameters (its layers, its TP shard), so no rank
ever holds the whole model; fused HF tensors (Phi-3's ``qkv_proj``, GPT-2's
``c_attn``) are sliced at the offsets the family's ``hf_sources`` gives, and
vocabulary padding rows are zeroed.

Before any tensor is read the directory's files and headers are checked
(``hf_files``: regular files inside ``DIR`` only, bounded headers, every tensor the
model reads floating point) and so is the whole model against them (``hf_match``:
no tensor missing, unused or of another shape, on every stage alike); each tensor
is checked finite as it loads, so a quantized, damaged, NaN or mismatched
checkpoint stops the launch with its name instead of training on garbage.
``load_stage`` says what it read (``StageLoad``); ``hf_init`` makes the ranks agree
and prints it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from autohet_cli.hfconfig import context_changes, differences, load_hf_config
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.hf_files import (
    INDEX_FILE,
    SINGLE_FILE,
    HFWeightsError,
    check_directory,
    check_dtypes,
    scan,
)
from autohet_cli.runtime.hf_match import (
    base_prefix,
    check_match,
    describe,
    expected_tensors,
    ignorable,
    stored_names,
)
from autohet_cli.runtime.model_api import local_block
from autohet_cli.runtime.models import family_module
from autohet_cli.runtime.models.common import HFSource

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFWeightsError",
    "StageLoad",
    "load_hf_weights",
    "load_stage",
]


def check_config(spec: ModelSpec, directory: Path) -> tuple[str, ...]:
    """The directory's config.json must describe the plan's architecture (the launcher
    asks the same of every host first: ``launch.inputcheck``), but for a deliberate
    change of context (``hfconfig.CONTEXT_FIELDS``): returns those changes."""
    config = load_hf_config(str(directory / "config.json"))
    diffs = differences(spec, config)
    if diffs:
        raise HFWeightsError(
            f"{directory}/config.json does not describe the plan's model {spec.name!r} "
            f"({'; '.join(diffs)}); plan with --model {directory}/config.json"
        )
    return tuple(context_changes(spec, config))


class SafetensorsDir:
    """Tensor name -> file of a HF directory; files opened lazily, closed on exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tensors = scan(directory)  # headers checked: safe to hand to safetensors
        self.files = {name: e.file for name, e in self.tensors.items()}
        self.stored: dict[str, str] = {}  # our name -> the name in the file, where they differ
        self.base_prefix: str | None = None
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def adopt_base_prefix(self, wanted: Collection[str]) -> None:
        """Read a base-model save as the model's names (``hf_match.base_prefix``)."""
        prefix = base_prefix(self.tensors, wanted)
        if prefix is None:
            return
        self.base_prefix = prefix
        self.stored = stored_names(self.tensors, prefix)
        self.tensors = {ours: self.tensors[theirs] for ours, theirs in self.stored.items()}
        self.files = {name: e.file for name, e in self.tensors.items()}

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def slice(self, name: str) -> Any:
        if name not in self.files:
            raise HFWeightsError(f"{self.directory}: no tensor {name!r} in the checkpoint")
        file = self.files[name]
        if file not in self._open:
            from safetensors import safe_open

            handle = safe_open(str(self.directory / file), framework="pt")
            self._open[file] = self._stack.enter_context(handle)
        return self._open[file].get_slice(self.stored.get(name, name))


def read_block(
    files: SafetensorsDir,
    src: HFSource,
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    local_shape: tuple[int, ...],
) -> Tensor:
    """Our global tensor's block at ``offsets`` of ``local_shape``, from the HF tensor;
    fewer rows where ours run past the checkpoint's (vocabulary padding)."""
    hf = files.slice(src.name)
    hf_shape = tuple(hf.get_shape())
    rows = global_shape[0] if src.rows is None else src.rows
    want = (rows, *global_shape[1:])
    r0, n = offsets[0], local_shape[0]
    ra, rb = min(r0, rows), min(r0 + n, rows)
    a, b = src.offset + ra, src.offset + rb
    if src.transposed:
        have = (hf_shape[1], hf_shape[0]) if len(hf_shape) == 2 else hf_shape
        c0, c1 = offsets[1], offsets[1] + local_shape[1]
        fits = have[1] == want[1] and src.offset + rows <= have[0]
        block = hf[c0:c1, a:b].t() if fits else None
    else:
        fits = hf_shape[1:] == want[1:] and src.offset + rows <= hf_shape[0]
        cols = tuple(slice(o, o + s) for o, s in zip(offsets[1:], local_shape[1:], strict=True))
        block = hf[(slice(a, b), *cols)] if fits else None
    if block is None:
        raise HFWeightsError(
            f"{files.directory}: tensor {src.name!r} has shape {list(hf_shape)}, which does "
            f"not hold {list(want)} at row {src.offset}{' (transposed)' if src.transposed else ''}"
        )
    whole: Tensor = block
    return whole  # rows past the checkpoint's (vocabulary padding) are _padded's


def _padded(block: Tensor, local_shape: tuple[int, ...]) -> Tensor:
    """``block`` with zero rows below it up to ``local_shape`` (vocabulary padding)."""
    if tuple(block.shape) == local_shape:
        return block
    out = torch.zeros(local_shape, dtype=block.dtype)
    out[: block.shape[0]] = block
    return out


def named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter under every full name (tied copies once per name)."""
    yield from module.named_parameters(remove_duplicate=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLoad:
    """What one rank read of ``--init-from`` (its layers, its TP shard)."""

    num_params: int  # our parameters filled
    num_tensors: int  # the checkpoint's tensors they came from
    num_bytes: int  # read from disk, as stored
    stored_dtypes: tuple[str, ...]  # the format's names: BF16, F32, ...
    dtype: str  # what they were converted to: the parameters' dtype
    checkpoint: str  # the whole checkpoint's line (hf_match.describe)
    changed: tuple[str, ...] = ()  # the plan's deliberate changes (hfconfig.context_changes)


def load_hf_weights(module: nn.Module, spec: ModelSpec, directory: str | Path) -> int:
    """``load_stage``'s number of parameters filled."""
    return load_stage(module, spec, directory).num_params


@torch.no_grad()
def load_stage(module: nn.Module, spec: ModelSpec, directory: str | Path) -> StageLoad:
    """Fill ``module``'s parameters (full names ``layers.<i>.<name>``) from ``directory``,
    after checking the whole model against its headers. Every parameter must have a
    HF source: ``--init-from`` works with the built-in model families."""
    root = Path(directory)
    check_directory(root)
    changed = check_config(spec, root)
    sources = family_module(spec).hf_sources(spec)
    expected = expected_tensors(spec)
    names: set[str] = set()
    num_params = num_bytes = 0
    dtype = ""
    with SafetensorsDir(root) as files:
        files.adopt_base_prefix(expected.required)
        known = {n for n in files.tensors if ignorable(n, expected)}
        check_dtypes(root, files.tensors, {*expected.required, *known})
        check_match(root, files.tensors, spec, expected)
        for name, param in named_tensors(module):
            src = sources.get(name)
            if src is None:
                raise HFWeightsError(
                    f"parameter {name!r} has no HuggingFace counterpart; --init-from works "
                    "with the built-in model families' layers"
                )
            local, global_shape, offsets = local_block(param)
            block = _read(files, src, global_shape, offsets, local)
            num_bytes += block.numel() * block.element_size()
            value = _padded(block, tuple(local.shape)).to(local.dtype)
            local.copy_(_finite(files, src.name, value))
            names.add(src.name)
            num_params += 1
            dtype = str(local.dtype).removeprefix("torch.")
        return StageLoad(
            num_params=num_params,
            num_tensors=len(names),
            num_bytes=num_bytes,
            stored_dtypes=tuple(sorted({files.tensors[n].dtype for n in names})),
            dtype=dtype,
            checkpoint=describe(root, files.tensors, expected, base_prefix=files.base_prefix),
            changed=changed,
        )


def _read(
    files: SafetensorsDir,
    src: HFSource,
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    local: Tensor,
) -> Tensor:
    """This rank's block of ``src`` as stored; safetensors' errors named."""
    from safetensors import SafetensorError

    try:
        block = read_block(files, src, global_shape, offsets, tuple(local.shape))
    except (SafetensorError, OSError) as exc:
        path = files.directory / files.files.get(src.name, "?")
        raise HFWeightsError(
            f"{path}: cannot read tensor {src.name!r}: {exc}; the file is damaged: "
            "download or save it again"
        ) from None
    return block


def _finite(files: SafetensorsDir, name: str, value: Tensor) -> Tensor:
    """``value`` if it holds no NaN or infinity: training from one is NaN from step 1."""
    if bool(torch.isfinite(value).all()):
        return value
    path = files.directory / files.files[name]
    stored = files.tensors[name].dtype
    raise HFWeightsError(
        f"{path}: tensor {name!r} holds NaN or infinite values (or {stored} values "
        f"beyond {value.dtype}'s range); --init-from needs finite weights: repair or "
        "re-export the checkpoint"
    )
