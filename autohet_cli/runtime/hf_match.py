"""Does a HuggingFace checkpoint hold this model, whole? Names and shapes, from headers.

``--init-from`` loads each rank's own layers only, so without this check a
checkpoint of another model (another family, another size, a config.json that is
not the weights') would fail on some stage's first unreadable tensor, or not at
all: an extra tensor the model has no place for was dropped without a word.
Every rank checks the whole model here before reading any data, from what costs
no tensor reads: the safetensors headers (names, shapes, dtypes) on one side and,
on the other, the shapes the family's layers have for the plan's architecture
(built on the meta device, one layer per kind) mapped to HuggingFace names by the
family's ``hf_sources``. So every rank reaches the same verdict, and a refusal
names the tensors: missing, unused, or of another shape.

Not refused: the buffers older saves carry that hold no weights (LLaMA's
``rotary_emb.inv_freq``, GPT-2's causal masks ``attn.bias``/``attn.masked_bias``),
and an ``lm_head.weight`` beside the embedding when the config ties them
(transformers ignores it too). They are named as ignored in the load line.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from autohet_cli.limits import size_text
from autohet_cli.models import ModelSpec
from autohet_cli.runtime.hf_files import (
    FLOAT_DTYPES,
    INDEX_FILE,
    OTHER_DTYPES,
    HFWeightsError,
    TensorEntry,
    check_dtypes,
)
from autohet_cli.runtime.model_api import ModelRequest
from autohet_cli.runtime.models import family_module

# Tensors saved by older transformers that are buffers, not weights.
KNOWN_BUFFERS = re.compile(
    r"(^|\.)rotary_emb\.inv_freq$|^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$"
)
SHOWN = 4  # names a refusal lists per kind of problem (all within 500 characters)
TIED_HEAD = "lm_head.weight"
DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Expected:
    """The HuggingFace tensors the model reads, and their shapes."""

    required: Mapping[str, tuple[int, ...]]
    optional: Mapping[str, tuple[int, ...]]  # a tied head's own copy, which some saves keep


def model_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Full parameter name -> global shape for the whole model, built on the meta
    device (no memory, no init). The families build a layer from its kind alone, so
    one layer per kind is built."""
    family = family_module(spec)
    request = ModelRequest(
        model_name=spec.name,
        num_layers=spec.num_layers,
        layer_start=0,
        layer_end=spec.num_layers,
        seed=0,
        seq_len=1,  # buffers only (rotary tables): no parameter depends on it
        micro_batch_size=1,
        architecture=spec,
        on_meta=True,
    )
    by_kind: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    out = {}
    for layer in spec.layers():
        if layer.kind not in by_kind:
            with torch.device("meta"):
                module = family.make_layer(spec, layer.index, request)
            by_kind[layer.kind] = [
                (n, tuple(p.shape)) for n, p in module.named_parameters(remove_duplicate=False)
            ]
        for name, shape in by_kind[layer.kind]:
            out[f"layers.{layer.index}.{name}"] = shape
    return out


def expected_tensors(spec: ModelSpec) -> Expected:
    """Each HuggingFace tensor the model reads, with the shape our parameters need of
    it: fused tensors (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) span their parts'
    rows; vocabulary padding is ours, not the checkpoint's."""
    shapes = model_shapes(spec)
    spans: dict[str, tuple[int, tuple[int, ...], bool]] = {}  # name -> rows, rest, transposed
    for ours, src in family_module(spec).hf_sources(spec).items():
        shape = shapes[ours]
        end = src.offset + (shape[0] if src.rows is None else src.rows)
        rows, rest, _ = spans.get(src.name, (0, shape[1:], src.transposed))
        if rest != shape[1:]:
            raise AssertionError(f"{src.name}: parts of shapes {rest} and {shape[1:]}")
        spans[src.name] = (max(rows, end), rest, src.transposed)
    required = {
        name: (rest[0], rows, *rest[1:]) if transposed else (rows, *rest)
        for name, (rows, rest, transposed) in spans.items()
    }
    optional = {}
    head = f"layers.{spec.num_layers - 1}.{TIED_HEAD}"
    if spec.tied_embeddings and TIED_HEAD not in required and head in shapes:
        src = family_module(spec).hf_sources(spec)[head]
        optional[TIED_HEAD] = required[src.name]
    return Expected(required=required, optional=optional)


def check_headers(directory: Path, tensors: Mapping[str, TensorEntry], spec: ModelSpec) -> None:
    """What ``hf_weights.load_stage`` checks before it reads a byte, from the headers
    alone: dtypes, then names and shapes against the whole model (a base-model save
    read under its prefix). The launcher asks it of every host before any worker
    starts (``launch.inputcheck``), so a dry run refuses what the workers would."""
    expected = expected_tensors(spec)
    prefix = base_prefix(tensors, expected.required)
    if prefix is not None:
        tensors = {ours: tensors[theirs] for ours, theirs in stored_names(tensors, prefix).items()}
    known = {n for n in tensors if ignorable(n, expected)}
    check_dtypes(directory, tensors, {*expected.required, *known})
    check_match(directory, tensors, spec, expected)


def stored_names(stored: Collection[str], prefix: str) -> dict[str, str]:
    """Our name -> the stored one, for a base-model save (``base_prefix``): the body's
    names gain the prefix, a head keeps its own."""
    head = [n for n in stored if n.startswith("lm_head.")]
    body = {prefix + n: n for n in stored if not n.startswith("lm_head.")}
    return body | {n: n for n in head}


def ignorable(name: str, expected: Expected) -> bool:
    return name in expected.optional or bool(KNOWN_BUFFERS.search(name))


def check_match(
    directory: Path, tensors: Mapping[str, TensorEntry], spec: ModelSpec, expected: Expected
) -> None:
    """Raise ``HFWeightsError`` naming the tensors when the checkpoint is not the model
    config.json describes: a tensor missing, one the model has no place for, or one
    of another shape."""
    wanted = {**expected.optional, **expected.required}
    missing = sorted((n for n in expected.required if n not in tensors), key=natural)
    unused = sorted(
        (n for n in tensors if n not in wanted and not ignorable(n, expected)), key=natural
    )
    reshaped = sorted(
        (n for n, shape in wanted.items() if n in tensors and tensors[n].shape != shape),
        key=natural,
    )
    if not (missing or unused or reshaped):
        return
    problems = []
    if reshaped:
        shown = [f"{n} {list(tensors[n].shape)}, model {list(wanted[n])}" for n in reshaped]
        problems.append(f"{_count(reshaped, 'tensor')} of another shape: {some(shown, 3)}")
    if missing:
        problems.append(f"{_count(missing, 'tensor')} missing: {some(missing)}")
    if unused:
        problems.append(f"{_count(unused, 'tensor')} the model has no place for: {some(unused)}")
    raise HFWeightsError(
        f"{directory}: the checkpoint is not the model config.json describes ({spec.num_blocks} "
        f"blocks, hidden size {spec.hidden_size}): "
        + "; ".join(problems)
        + "; "
        + _likely_cause(missing=missing, unused=unused, reshaped=reshaped)
    )


def _likely_cause(*, missing: list[str], unused: list[str], reshaped: list[str]) -> str:
    """Kept short: the launch's root cause shows a worker error's first 500 characters."""
    if missing == [TIED_HEAD] and not unused and not reshaped:
        return 'a head tied to the embedding? then config.json says "tie_word_embeddings": true'
    if reshaped and not missing and not unused:
        return (
            "is config.json another model's (or another size's)? Use the one saved with "
            "the weights and plan from it"
        )
    return (
        "another model's weights, or a config.json not theirs? Use the weights with the "
        "config.json saved beside them and plan from it"
    )


# The ``base_model_prefix`` of the HF classes the families map to: GPT2LMHeadModel's
# body is ``transformer.``, LlamaForCausalLM's (Mistral, Qwen2, Phi-3) ``model.``.
BASE_PREFIXES = ("transformer.", "model.")


def base_prefix(stored: Collection[str], wanted: Collection[str]) -> str | None:
    """The prefix a base-model save lacks, when ``stored`` is one (None otherwise).

    The hub's original ``gpt2`` was saved from ``GPT2Model``: ``h.0.attn.c_attn.weight``,
    ``wte.weight``, no ``transformer.`` and no head (tied). transformers'
    ``from_pretrained`` adds the prefix (``base_model_prefix``); so do we, when no
    stored name has it and it makes most of the model's names appear."""
    for prefix in BASE_PREFIXES:
        body = [n for n in wanted if n.startswith(prefix)]
        if not body or any(n.startswith(prefix) for n in stored):
            continue
        have = set(stored)
        if 2 * sum(n[len(prefix) :] in have for n in body) > len(body):
            return prefix
    return None


def describe(
    directory: Path,
    tensors: Mapping[str, TensorEntry],
    expected: Expected,
    *,
    base_prefix: str | None = None,
) -> str:
    """The load line for the checkpoint: files, tensors, bytes, dtypes, what matched."""
    files = sorted({e.file for e in tensors.values()}, key=natural)
    dtypes = sorted({e.dtype for e in tensors.values()})
    num_bytes = sum(nbytes(e) for e in tensors.values())
    via = f" (via {INDEX_FILE})" if (directory / INDEX_FILE).exists() else ""
    ignored = sorted((n for n in tensors if ignorable(n, expected)), key=natural)
    note = f"; ignored: {some(ignored)} (no weights the model trains)" if ignored else ""
    if base_prefix is not None:
        note += f"; saved from the base model: names read with {base_prefix!r} before them"
    return (
        f"--init-from {directory}: {_count(list(tensors), 'tensor')}, {size_text(num_bytes)} "
        f"of {', '.join(DTYPE_NAMES.get(d, d) for d in dtypes)} in "
        f"{_count(files, 'file')}{via}: {some(files, 3)}; every tensor of the model "
        f"({len(expected.required)}) found with its shape, none missing, none unused{note}"
    )


def nbytes(entry: TensorEntry) -> int:
    size = FLOAT_DTYPES.get(entry.dtype) or OTHER_DTYPES.get(entry.dtype, ("", 1))[1] or 1
    numel = 1
    for d in entry.shape:
        numel *= d
    return numel * size


def natural(name: str) -> tuple[tuple[int, str], ...]:
    """``layers.2`` before ``layers.10``."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", name))


def some(names: list[str], limit: int = SHOWN) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"
