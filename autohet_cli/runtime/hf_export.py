"""HuggingFace weights out: a checkpoint written under any plan as config.json + safetensors.

The checkpoint is DCP, keyed by full parameter names whatever plan wrote it
(docs/checkpoint-format.md), so export needs no plan shapes: DCP's own reader
loads whole tensors by name, resharding TP and stage cuts as it does on resume.
Tensors stream one output file at a time: a file's tensors are loaded, converted
(vocabulary padding dropped, Phi-3's q/k/v and gate/up and GPT-2's c_attn fused,
GPT-2's Conv1D weights transposed, per the family's ``hf_sources``) and written
before the next file's are read, so memory stays near one file (``max_shard_bytes``)
plus the largest tensor. Several files come with ``model.safetensors.index.json``,
as ``save_pretrained`` writes them.

Nothing is read from the step directory after it was checked (``ckpt.verified``):
``.metadata`` is unpickled from the bytes whose sha256 was checked, and DCP reads
the tensors from a private copy made of the data files' checked bytes, so a file
swapped in the step directory between check and use is never read (issue 45).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from autohet_cli.errors import AutohetError
from autohet_cli.hfconfig import to_hf_config
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.grouping import consecutive_groups
from autohet_cli.runtime.hf_weights import INDEX_FILE, SINGLE_FILE
from autohet_cli.runtime.models import family_module
from autohet_cli.runtime.models.common import HFSource

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from autohet_cli.ckpt.format import Manifest
    from autohet_cli.ckpt.verified import VerifiedReader

MODEL_PREFIX = "model."  # Trainer.state_dict()'s model entries, as DCP flattens them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(AutohetError):
    """A checkpoint cannot be exported; the message names the file or the fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HFTensor:
    """One tensor of the HF checkpoint and the pieces of ours it is made of."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[str, HFSource], ...]  # (our full name, where it goes), by offset

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """What export reads of a step directory: its authenticated manifest and DCP's
    metadata verified against it (``open_checkpoint``); tensors come later, through
    DCP's reader on a verified copy (``export_hf``)."""

    step_dir: Path
    shapes: dict[str, tuple[int, ...]]  # our full name -> global shape
    dtypes: dict[str, torch.dtype]
    plan_ref: str | None  # "name.vN" of the plan that wrote it, from the manifest
    plan_sha256: str | None = None  # of that plan file's bytes, from the manifest
    manifest: Manifest | None = field(default=None, compare=False, repr=False)
    metadata: Metadata | None = field(default=None, compare=False, repr=False)


def open_checkpoint(step_dir: str | Path) -> Checkpoint:
    """The model tensors of a complete, authentic checkpoint step directory.

    The one place export touches the checkpoint format (``autohet_cli.ckpt.format``):
    the manifest must verify with the job key (``<job dir>/.autohet-key``), every file
    it lists must be here, a regular file of the size it lists, and ``.metadata`` is
    unpickled only from the bytes whose sha256 it lists (``ckpt.verified``). The data
    files' sha256 are checked as ``export_hf`` copies them, on the bytes it loads.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autohet_cli.ckpt.files import incomplete_reason, read_key
    from autohet_cli.ckpt.format import MANIFEST, verified_manifest
    from autohet_cli.ckpt.verified import OWN_FILES, load_metadata

    root = Path(step_dir)
    key = read_key(root.parent) if root.parent.is_dir() else None
    why = incomplete_reason(root, key)
    if why is not None:
        raise ExportError(
            f"{root}: not a complete checkpoint ({why}); pass a finished "
            "<checkpoint_dir>/<plan>/<job>/step-<N> directory on a host that holds its job key"
        )
    assert key is not None
    text = (root / MANIFEST).read_text(encoding="utf-8")
    manifest = verified_manifest(text, key, str(root / MANIFEST))
    for f in manifest.files:
        path = root / f.path
        if not os.path.lexists(path):
            raise ExportError(
                f"{path} is missing (host {f.host} wrote it); copy every host's files of this "
                "step into one directory first"
            )
        st = path.lstat()  # checked again on the descriptor each file is read through
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise ExportError(f"{path} is {what}; {OWN_FILES}")
        if st.st_size != f.num_bytes:
            raise ExportError(
                f"{path} is corrupt: it has {st.st_size} bytes, {MANIFEST} says {f.num_bytes}"
            )
    metadata = load_metadata(root, manifest, ExportError)  # a symlink or FIFO: refused
    shapes, dtypes = {}, {}
    for name, meta in metadata.state_dict_metadata.items():
        if name.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            ours = name.removeprefix(MODEL_PREFIX)
            shapes[ours] = tuple(meta.size)
            dtypes[ours] = meta.properties.dtype
    return Checkpoint(
        step_dir=root,
        shapes=shapes,
        dtypes=dtypes,
        plan_ref=manifest.plan,
        plan_sha256=manifest.plan_sha256,
        manifest=manifest,
        metadata=metadata,
    )


def hf_tensors(spec: ModelSpec, ckpt: Checkpoint) -> list[HFTensor]:
    """The HF tensors of ``spec``, each from its pieces in the checkpoint."""
    groups: dict[str, dict[int, tuple[str, HFSource]]] = {}
    for ours, src in family_module(spec).hf_sources(spec).items():
        if ours not in ckpt.shapes:
            raise ExportError(f"{ckpt.step_dir}: the checkpoint has no tensor {ours!r}")
        groups.setdefault(src.name, {}).setdefault(src.offset, (ours, src))  # tied: once
    out = []
    for name, by_offset in groups.items():
        pieces = tuple(by_offset[o] for o in sorted(by_offset))
        ours, src = pieces[-1]
        shape = ckpt.shapes[ours]
        rows = src.offset + (shape[0] if src.rows is None else src.rows)
        if src.transposed:
            full: tuple[int, ...] = (shape[1], rows)
        else:
            full = (rows, *shape[1:])
        out.append(HFTensor(name=name, shape=full, pieces=pieces))
    return out


def _load(
    ckpt: Checkpoint, names: list[str], reader: Callable[[], VerifiedReader]
) -> dict[str, Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import load

    state = {MODEL_PREFIX + n: torch.empty(ckpt.shapes[n], dtype=ckpt.dtypes[n]) for n in names}
    # One process, even where a process group exists. torch 2.5's ``load`` has no
    # ``no_dist`` and decides by itself: one process when no group is initialised.
    one = {"no_dist": True} if "no_dist" in inspect.signature(load).parameters else {}
    with warnings.catch_warnings():  # "no process group: loading in one process": intended
        warnings.simplefilter("ignore", UserWarning)
        load(state, storage_reader=reader(), **one)
    return {n: state[MODEL_PREFIX + n] for n in names}


def _assemble(t: HFTensor, ours: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
    parts = []
    for name, src in t.pieces:
        value = ours[name]
        if src.rows is not None:
            value = value[: src.rows]  # drop vocabulary padding
        parts.append(value.t() if src.transposed else value)
    joined = torch.cat(parts, dim=1 if t.pieces[0][1].transposed else 0)
    assert tuple(joined.shape) == t.shape, (t.name, joined.shape, t.shape)
    return joined.to(dtype).contiguous()


def _files(groups: list[list[HFTensor]]) -> Iterator[tuple[str, list[HFTensor]]]:
    if len(groups) == 1:
        yield SINGLE_FILE, groups[0]
        return
    for i, group in enumerate(groups, 1):
        yield f"model-{i:05d}-of-{len(groups):05d}.safetensors", group


def export_hf(
    ckpt: Checkpoint,
    spec: ModelSpec,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> list[Path]:
    """Write ``out_dir`` (must not exist): config.json, safetensors file(s), index if several."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    _refuse_existing(out)
    stored = ckpt.dtypes[next(iter(ckpt.dtypes))]
    name = dtype or next((k for k, v in DTYPES.items() if v == stored), "float32")
    if name not in DTYPES:
        raise ExportError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    tensors = hf_tensors(spec, ckpt)
    groups = consecutive_groups(tensors, max_shard_bytes, DTYPES[name].itemsize)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise ExportError(f"{out.parent}: cannot create the output there: {exc.strerror}") from None
    try:
        weight_map, written = {}, []
        with _verified(ckpt, tensors, near=out.parent) as reader:
            for file, group in _files(groups):
                ours = _load(ckpt, [n for t in group for n, _ in t.pieces], reader)
                data = {t.name: _assemble(t, ours, DTYPES[name]) for t in group}
                del ours
                save_file(data, str(tmp / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(data, file))
                written.append(out / file)
        if len(groups) > 1:
            total = sum(t.numel() * DTYPES[name].itemsize for t in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = to_hf_config(spec, torch_dtype=name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        _refuse_existing(out)  # made while we wrote: an empty directory would be replaced
        tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" ({exc.filename})" if exc.filename else ""
        raise ExportError(
            f"{out}: export failed: {exc.strerror or exc}{where}; nothing was written"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / "config.json", *written]


def _verified(
    ckpt: Checkpoint, tensors: list[HFTensor], *, near: Path
) -> AbstractContextManager[Callable[[], VerifiedReader]]:
    """The data files' bytes that hold ``tensors``, copied and checked (``ckpt.verified``)."""
    from autohet_cli.ckpt.verified import verified_copy

    if ckpt.manifest is None or ckpt.metadata is None:
        raise ExportError(f"{ckpt.step_dir}: open it with open_checkpoint to export it")
    entries = {MODEL_PREFIX + n for t in tensors for n, _ in t.pieces}
    return verified_copy(
        ckpt.step_dir, ckpt.manifest, ckpt.metadata, entries, near=near, error=ExportError
    )


def _refuse_existing(out: Path) -> None:
    """Export never overwrites, nor writes through a symlink (even a dangling one)."""
    if out.is_symlink():
        raise ExportError(
            f"{out}: is a symlink (to {os.readlink(out)}); export never writes through one, "
            "name a new directory"
        )
    if os.path.lexists(out):
        raise ExportError(f"{out}: already exists; export never overwrites, name a new directory")


def spec_for(ckpt: Checkpoint, plan_file: str | Path | None) -> ModelSpec:
    """The model of the plan that wrote ``ckpt``: ``plan_file``, else plans/<its plan>.yaml."""
    from autohet_cli.models import get_model
    from autohet_cli.plan import load_plan

    path = Path(plan_file) if plan_file else None
    if path is None and ckpt.plan_ref:
        path = Path("plans") / f"{ckpt.plan_ref}.yaml"
    if path is None or not path.is_file():
        raise ExportError(
            f"{ckpt.step_dir}: cannot find the plan that wrote it "
            f"({ckpt.plan_ref or 'unknown'}; looked for {path}); pass --plan PLAN_FILE"
        )
    plan = load_plan(path)
    spec = plan.architecture or get_model(plan.model_name)
    _check_provenance(ckpt, path, spec)
    return spec


def _check_provenance(ckpt: Checkpoint, path: Path, spec: ModelSpec) -> None:
    """``path`` describes the model the checkpoint holds: another plan of the same name
    (another model in plans/, an edited copy) would describe other shapes or heads, and
    config.json would say 8 heads for a 4-head checkpoint. A manifest that records the
    architecture (``ckpt.lineage``) is compared field by field, so any plan of that
    model will do (the first version, or a recovered one); an older manifest only has
    the sha256 of the plan that wrote it."""
    from autohet_cli.ckpt.lineage import model_differences, model_record
    from autohet_cli.yamlio import sha256_file

    saved = ckpt.manifest.model if ckpt.manifest is not None else None
    if saved is not None:
        differ = model_differences(saved, model_record(spec))
        if differ:
            raise ExportError(
                f"{ckpt.step_dir} holds the weights of another model than {path} describes: "
                + "; ".join(differ)
                + f". Pass --plan with a plan of the model the job trained ({ckpt.plan_ref}"
                ".yaml as launch or recover wrote it)"
            )
        return
    if ckpt.plan_sha256 is None:
        return
    have = sha256_file(path)
    if have != ckpt.plan_sha256:
        raise ExportError(
            f"{ckpt.step_dir} was written under plan {ckpt.plan_ref} with sha256 "
            f"{ckpt.plan_sha256[:12]}…, but {path} has sha256 {have[:12]}… (another plan, or "
            f"an edited copy, whose model may differ); pass --plan with the plan file the job "
            f"ran with ({ckpt.plan_ref}.yaml as launch or recover wrote it)"
        )


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``40KB`` (powers of 1000, as transformers') or bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    value = text.strip().upper()
    for unit, factor in units.items():
        if value.endswith(unit) and value[: -len(unit)].strip().isdigit():
            return int(value[: -len(unit)]) * factor
    if value.isdigit():
        return int(value)
    raise ExportError(f"size {text!r}: expected bytes or a number with KB, MB, GB or TB")
