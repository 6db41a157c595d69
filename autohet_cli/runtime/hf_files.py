"""What a HuggingFace safetensors directory holds, read and checked before any tensor is.

``--init-from DIR`` is user input that runs before the health monitor and the
start timeout, so nothing here may hang, exhaust memory or end in a traceback:
every file is opened as a regular file only (``regular_file``: a named pipe or a
device is refused, not waited on); the index must map tensor names to files
inside ``DIR`` (no absolute or ``..`` paths); each safetensors header is parsed
here with bounds (its length, JSON depth, dtypes, shapes, data offsets inside the
file) before safetensors' own reader sees the file. Every error names the file and
the field. Torch-free: the dtypes are the format's names (``F32``, ``I8``, ...).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from autohet_cli.errors import AutohetError
from autohet_cli.regular_file import open_regular, read_regular

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
METADATA_KEY = "__metadata__"
# safetensors' own limit (MAX_HEADER_SIZE): a header past it is not a checkpoint's.
MAX_HEADER_BYTES = 100_000_000
# An index lists tensor names; 100,000 tensors take ~10 MB.
MAX_INDEX_BYTES = 64 << 20
MAX_DIMS = 16
# The dtypes --init-from reads (cast to the model's dtype), and their sizes.
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
# Every other dtype of the format: what it is, and its size (None: under a byte).
OTHER_DTYPES: dict[str, tuple[str, int | None]] = {
    "BOOL": ("booleans", 1),
    "U8": ("8-bit unsigned integers", 1),
    "I8": ("8-bit integers, as int8-quantized weights store them", 1),
    "U16": ("16-bit unsigned integers", 2),
    "I16": ("16-bit integers", 2),
    "U32": ("32-bit unsigned integers", 4),
    "I32": ("32-bit integers, as GPTQ/AWQ pack 4-bit weights", 4),
    "U64": ("64-bit unsigned integers", 8),
    "I64": ("64-bit integers", 8),
    "F8_E4M3": ("float8 quantized weights, whose scales live in other tensors", 1),
    "F8_E5M2": ("float8 quantized weights, whose scales live in other tensors", 1),
    "F8_E8M0": ("float8 scales of a quantized checkpoint", 1),
    "F6_E2M3": ("6-bit quantized weights", None),
    "F6_E3M2": ("6-bit quantized weights", None),
    "F4": ("4-bit quantized weights", None),
    "C64": ("complex numbers", 8),
}
# Names of the extra tensors quantized checkpoints carry (bitsandbytes' SCB and
# quant_state, GPTQ/AWQ's qweight/qzeros/scales/g_idx, FP8's weight_scale[_inv]).
_QUANTIZATION_NAME = re.compile(
    r"\.(SCB|weight_format|absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..+"
    r"|qweight|qzeros|scales|g_idx|weight_scale|weight_scale_inv|input_scale"
    r"|weight_zero_point|weight_packed|weight_shape)$"
)


class HFWeightsError(AutohetError):
    """A HuggingFace model directory cannot be read into this plan's model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor as its safetensors header describes it."""

    file: str  # relative to the directory
    dtype: str
    shape: tuple[int, ...]


def scan(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of ``directory`` (its index's, or model.safetensors'), headers checked."""
    check_directory(directory)
    if os.path.lexists(directory / INDEX_FILE):  # a FIFO or dangling link is refused, not skipped
        weight_map = read_index(directory / INDEX_FILE)
        headers = {f: read_header(directory, f) for f in sorted(set(weight_map.values()))}
        out = {}
        for name, file in weight_map.items():
            entry = headers[file].get(name)
            if entry is None:
                raise HFWeightsError(
                    f"{directory / INDEX_FILE}: weight_map puts tensor {name!r} in {file}, "
                    "which does not hold it; the index and the files are from different saves"
                )
            out[name] = entry
        return out
    if os.path.lexists(directory / SINGLE_FILE):
        return read_header(directory, SINGLE_FILE)
    raise HFWeightsError(
        f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are "
        "read; convert a pytorch_model.bin with transformers' save_pretrained)"
    )


def check_directory(directory: Path) -> None:
    """``directory`` is one (a symlink loop or a file is refused by name)."""
    try:
        is_dir = stat.S_ISDIR(directory.stat().st_mode)
    except OSError as exc:  # ELOOP: a symlink loop; ENOENT
        raise HFWeightsError(
            f"{directory}: cannot open the --init-from directory: {exc.strerror or exc}"
        ) from None
    if not is_dir:
        raise HFWeightsError(f"{directory}: not a directory; --init-from takes a model directory")


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of ``model.safetensors.index.json``: tensor name -> file in the directory."""
    raw = _json(read_regular(path, MAX_INDEX_BYTES, HFWeightsError), path, "index")
    if not isinstance(raw, dict):
        raise HFWeightsError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
        raise HFWeightsError(
            f"{path}: field 'weight_map' must map tensor names to safetensors files, "
            f"got {got}; regenerate the index (transformers' save_pretrained writes it)"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _inside(file):
            raise HFWeightsError(
                f"{path}: weight_map[{name!r}] = {file!r}: must name a file inside the "
                "model directory (a relative path without '..')"
            )
    return dict(weight_map)


def _inside(file: str) -> bool:
    p = PurePosixPath(file)
    return bool(file) and "\0" not in file and not p.is_absolute() and ".." not in p.parts


def read_header(directory: Path, file: str) -> dict[str, TensorEntry]:
    """The tensors of ``directory/file``, from a header checked against the file."""
    path = directory / file
    fd = open_regular(path, HFWeightsError)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise HFWeightsError(f"{path}: {size} bytes, too short for a safetensors file")
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise HFWeightsError(
                f"{path}: header length {n} bytes in a {size}-byte file: not a safetensors "
                "file, or a truncated or damaged one; download or save it again"
            )
        text = fh.read(n)
    raw = _json(text, path, "header")
    if not isinstance(raw, dict):
        raise HFWeightsError(f"{path}: header is not a JSON object")
    metadata = raw.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HFWeightsError(f"{path}: header field {METADATA_KEY!r} must map names to strings")
    data_bytes = size - 8 - n
    entries = {name: _entry(path, file, name, value, data_bytes) for name, value in raw.items()}
    _check_layout(path, raw, data_bytes)
    return entries


def _check_layout(path: Path, raw: dict[str, Any], data_bytes: int) -> None:
    """The tensors' bytes tile the data exactly, as safetensors writes (and requires) them."""
    end = 0
    for name, value in sorted(raw.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = value["data_offsets"]
        if begin != end:
            raise HFWeightsError(
                f"{path}: tensor {name!r}: data_offsets {[begin, stop]} "
                f"{'overlap another tensor' if begin < end else 'leave a gap'} "
                "(a damaged file)"
            )
        end = stop
    if end != data_bytes:
        raise HFWeightsError(
            f"{path}: the tensors hold {end} bytes of the file's {data_bytes} data bytes "
            "(a damaged file)"
        )


def _json(data: bytes, path: Path, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise HFWeightsError(f"{path}: {what} is not valid JSON ({why})") from None


def _entry(path: Path, file: str, name: str, raw: Any, data_bytes: int) -> TensorEntry:
    at = f"{path}: tensor {name!r}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise HFWeightsError(f"{at}: expected dtype, shape and data_offsets in the header")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in FLOAT_DTYPES and dtype not in OTHER_DTYPES:
        raise HFWeightsError(f"{at}: unknown dtype {dtype!r}")
    if not _ints(shape) or len(shape) > MAX_DIMS:
        raise HFWeightsError(f"{at}: shape {shape!r} is not a list of sizes >= 0")
    if not _ints(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= data_bytes:
        raise HFWeightsError(
            f"{at}: data_offsets {offsets!r} lie outside the file's {data_bytes} data bytes "
            "(a truncated or damaged file)"
        )
    itemsize = FLOAT_DTYPES.get(dtype) or OTHER_DTYPES[dtype][1]
    numel = 1
    for d in shape:
        numel *= d
    if itemsize is not None and numel * itemsize != offsets[1] - offsets[0]:
        raise HFWeightsError(
            f"{at}: shape {shape} of {dtype} needs {numel * itemsize} bytes, "
            f"data_offsets hold {offsets[1] - offsets[0]}"
        )
    return TensorEntry(file=file, dtype=dtype, shape=tuple(shape))


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def check_dtypes(directory: Path, tensors: Mapping[str, TensorEntry], used: Iterable[str]) -> None:
    """Every tensor the model reads is floating point, and none belongs to a quantized
    checkpoint: an int8 weight cast to float is its quantized integers, not the weight
    (training ran with a gradient norm of 3e12)."""
    used = set(used)
    unused = sorted(set(tensors) - used)
    wrong = sorted(n for n in used if n in tensors and tensors[n].dtype not in FLOAT_DTYPES)
    quantized = [
        n for n in unused if _QUANTIZATION_NAME.search(n) or tensors[n].dtype not in FLOAT_DTYPES
    ]
    if not wrong and not quantized:
        return
    problems = []
    if wrong:
        e = tensors[wrong[0]]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        problems.append(
            f"{directory / e.file}: tensor {wrong[0]!r} is {e.dtype} "
            f"({OTHER_DTYPES[e.dtype][0]}), not floating point{more}"
        )
    if unused:
        first = quantized + [n for n in unused if n not in quantized]
        problems.append(f"unused tensors the model has no place for: {_some(first)}")
    raise HFWeightsError(
        "; ".join(problems) + "; --init-from reads floating-point weights (F16, BF16, F32, "
        "F64) only: dequantize the checkpoint first (e.g. load it with transformers and "
        "save_pretrained it in bfloat16)"
    )


def _some(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
