"""A model's partitionable layers and what each costs: parameters, FLOPs, bytes kept (pure).

``ModelSpec.layers()`` builds them (``model_layers``); plans index them with
``layers: [start, end)`` and profiles are keyed by them. Split from ``modelspec``
(the spec) and ``models`` (the zoo) because what a layer keeps is the runtime's
own accounting: the residual stream and norms in fp32, autocast's per-projection
input copies, the head's chunked loss (``runtime.models.loss``), all checked
against the runtime's layers in tests/unit/test_memory_model.py.

The lowest of the model modules (``layerspec`` <- ``modelspec`` <- ``hfconfig`` <-
``models``): it reads a model through ``Shape``, the few fields its formulas use, so
it needs no import of ``ModelSpec``, whose ``layers()`` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

IGNORE_INDEX = -100  # torch's cross_entropy default: a target that adds no loss
# The runtime's head takes its loss in chunks of tokens whose fp32 logits hold at most
# this much (runtime.models.loss), so no micro-batch's whole logits are ever held.
CHUNK_LOGIT_BYTES = 256 * 2**20


# Its weight's gradient is formed once per group of chunks whose logits' gradient (in
# the compute dtype) holds at most this much: each formation reads and writes the
# whole fp32 weight gradient, which per 512-token chunk of a 128k vocabulary cost more
# memory traffic than the chunk's matmuls (measured on an H200: 9% of the step).
GROUP_LOGIT_BYTES = 2**30


def loss_group_tokens(tokens: int, vocab_rows: int, dtype_bytes: int) -> int:
    """Tokens per group of the head's chunks (a multiple of the chunk): their logits'
    gradient within ``GROUP_LOGIT_BYTES``, at least one chunk."""
    chunk = loss_chunk_tokens(tokens, vocab_rows)
    fit = GROUP_LOGIT_BYTES // (max(1, dtype_bytes) * max(1, vocab_rows))
    return max(chunk, min(tokens, fit - fit % chunk))


def loss_chunk_tokens(tokens: int, vocab_rows: int) -> int:
    """Tokens per chunk of the head's loss: fp32 logits within ``CHUNK_LOGIT_BYTES``,
    a multiple of 64 tokens where that is at least 64 (GEMM tiles)."""
    fit = CHUNK_LOGIT_BYTES // (4 * max(1, vocab_rows))
    if fit >= 64:
        fit -= fit % 64
    return max(1, min(tokens, fit))


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpec:
    """One partitionable layer. Per-token quantities; element counts, not bytes.

    What a layer keeps for backward is counted as our runtime keeps it (measured
    with ``saved_tensors_hooks``, tests/unit/test_memory_model.py): the residual
    stream and the norms' saved tensors in fp32 whatever the precision; under
    16-bit autocast a 16-bit copy of a norm's output for *each* projection that
    reads it (autocast casts per op: q, k and v each keep their own), under fp32
    the norm's output once; the rest in the compute dtype, split by TP.
    """

    index: int
    name: str
    kind: str  # embedding | block | norm | head
    num_params: int
    shared_params: int = 0  # a tied copy of the embedding: costs memory, counted once in totals
    matmul_flops_per_token: float = 0.0  # forward, 2 * GEMM parameters
    attn_flops_per_token_per_pos: float = 0.0  # forward, times sequence length
    act_fp32_elems_per_token_whole: float = 0.0  # kept in fp32 on every TP rank
    act_cast_elems_per_token_whole: float = 0.0  # 16-bit input copies (autocast), every rank
    act_norm_out_elems_per_token_whole: float = 0.0  # what those copies are under fp32
    act_elems_per_token_split: float = 0.0  # kept in the compute dtype, divided by TP
    act_fp32_elems_per_token_split: float = 0.0  # kept in fp32, divided by TP
    loss_vocab_rows: int = 0  # head: logits' rows (padded vocabulary); 0 for other layers
    loss_width: int = 0  # head: the width entering the head's matmul
    output_elems_per_token: float = 0.0  # sent to the next stage

    def fwd_flops(self, seq_len: int, micro_batch_size: int) -> float:
        per_token = self.matmul_flops_per_token + self.attn_flops_per_token_per_pos * seq_len
        return per_token * seq_len * micro_batch_size

    def act_bytes(self, seq_len: int, micro_batch_size: int, tp: int, dtype_bytes: int) -> float:
        """Bytes kept for backward per micro-batch, and for the head its loss's own
        (``loss_bytes``: the head sits on the last stage, one micro-batch in flight)."""
        tokens = seq_len * micro_batch_size
        mixed = dtype_bytes < 4
        whole = self.act_fp32_elems_per_token_whole * 4 + (
            self.act_cast_elems_per_token_whole * dtype_bytes
            if mixed
            else self.act_norm_out_elems_per_token_whole * 4
        )
        split = (
            self.act_elems_per_token_split * dtype_bytes + self.act_fp32_elems_per_token_split * 4
        ) / tp
        return tokens * (whole + split) + self.loss_bytes(tokens, tp, dtype_bytes)

    def loss_bytes(self, tokens: int, tp: int, dtype_bytes: int) -> float:
        """The head's chunked loss (``runtime.models.loss``), the larger of its two ways,
        beside the head's input, alive while it runs (one fp32 hidden state a token).

        Gradients formed in the forward (TP 1, no fp16): one fp32 weight gradient kept
        to backward and, under autocast, each group's 16-bit weight gradient before it
        is added; per chunk the 16-bit logits, their fp32 copy and the 16-bit gradient;
        per group of chunks (``loss_group_tokens``) their gradients, held together.
        (Its 16-bit weight copy is autocast's, in ``CostTables.cast_bytes``.)
        Recomputed chunks (TP, fp16): in backward one chunk's logits again in 16 and 32
        bits, the log-softmax output and the gradient in both, and the chunks' input
        gradients joined into one.
        """
        if not self.loss_vocab_rows:
            return 0.0
        rows = self.loss_vocab_rows / tp
        chunk = loss_chunk_tokens(tokens, int(rows)) * rows
        hidden = tokens * self.loss_width * 4
        recomputed = chunk * (2 * dtype_bytes + 3 * 4) + hidden
        if tp > 1:
            return hidden + recomputed
        weight = self.loss_vocab_rows * self.loss_width
        temp = weight * dtype_bytes if dtype_bytes < 4 else 0
        group = loss_group_tokens(tokens, int(rows), dtype_bytes) * rows * dtype_bytes
        in_forward = weight * 4 + temp + chunk * (2 * dtype_bytes + 4) + group
        return hidden + max(in_forward, recomputed)

    def output_bytes(self, seq_len: int, micro_batch_size: int, dtype_bytes: int) -> float:
        return seq_len * micro_batch_size * self.output_elems_per_token * dtype_bytes


class Shape(Protocol):
    """What the layer formulas read of a model (``modelspec.ModelSpec`` has it all).

    Read-only and hashable: ``model_layers`` caches its answer per model.
    """

    @property
    def num_blocks(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def padded_vocab_size(self) -> int: ...
    @property
    def num_positions(self) -> int: ...
    @property
    def gated_mlp(self) -> bool: ...
    @property
    def bias(self) -> bool: ...
    @property
    def qkv_bias(self) -> bool | None: ...
    @property
    def norm(self) -> str: ...
    @property
    def tied_embeddings(self) -> bool: ...
    @property
    def final_norm(self) -> bool: ...
    @property
    def separate_final_norm(self) -> bool: ...
    @property
    def embed_proj_dim(self) -> int: ...


def _norm_saved(m: Shape) -> float:
    """fp32 elements per token one norm keeps: RMSNorm (written out by torch) its
    input, input * rstd and rstd; LayerNorm its input, mean and rstd."""
    h = m.hidden_size
    return 2.0 * h + 1 if m.norm == "rmsnorm" else h + 2.0


def _norm_params(m: Shape) -> int:
    return m.hidden_size * (1 if m.norm == "rmsnorm" else 2)


def _block(m: Shape, index: int) -> LayerSpec:
    h, f = m.hidden_size, m.ffn_hidden_size
    kv = m.num_kv_heads * m.head_dim
    qkv_bias = m.bias if m.qkv_bias is None else m.qkv_bias
    attn = h * h + 2 * h * kv + h * h
    attn_bias = (h + 2 * kv if qkv_bias else 0) + (h if m.bias else 0)
    mlp = (3 if m.gated_mlp else 2) * h * f
    mlp_bias = (f + h) if m.bias else 0
    params = attn + attn_bias + mlp + mlp_bias + 2 * _norm_params(m)
    return LayerSpec(
        index=index,
        name=f"block.{index - 1}",
        kind="block",
        num_params=params,
        matmul_flops_per_token=2.0 * (attn + mlp),
        attn_flops_per_token_per_pos=4.0 * h,
        # Two norms; their outputs go to q, k, v and to gate and up (or fc).
        act_fp32_elems_per_token_whole=2 * _norm_saved(m),
        # (+ rotary tables cast per forward: cos and sin, counted as if per token)
        act_cast_elems_per_token_whole=(3.0 + (2 if m.gated_mlp else 1)) * h
        + (0 if m.num_positions else 2.0 * m.head_dim),
        act_norm_out_elems_per_token_whole=2.0 * h,
        # q and k (rotated), v, the attention output; MLP: gate, up, act(gate) and
        # their product, or fc's output and its activation.
        act_elems_per_token_split=2.0 * h + 2 * kv + (4 if m.gated_mlp else 2) * f,
        act_fp32_elems_per_token_split=float(m.num_heads),  # attention's logsumexp
        output_elems_per_token=float(h),
    )


@lru_cache(maxsize=256)
def model_layers(m: Shape) -> tuple[LayerSpec, ...]:
    h, vocab = m.hidden_size, m.padded_vocab_size
    e = m.embed_proj_dim or h
    proj = e * h if m.embed_proj_dim else 0
    layers = [
        LayerSpec(
            index=0,
            name="embedding",
            kind="embedding",
            num_params=vocab * e + m.num_positions * h + proj,
            matmul_flops_per_token=2.0 * proj,
            output_elems_per_token=float(h),
        )
    ]
    layers += [_block(m, i) for i in range(1, m.num_blocks + 1)]
    norm = _norm_params(m) if m.final_norm else 0
    if m.separate_final_norm:
        layers.append(
            LayerSpec(
                index=len(layers),
                name="final_norm",
                kind="norm",
                num_params=norm,
                act_fp32_elems_per_token_whole=_norm_saved(m),
                output_elems_per_token=float(h),
            )
        )
        norm = 0
    layers.append(
        LayerSpec(
            index=len(layers),
            name="head",
            kind="head",
            num_params=norm + proj + vocab * e,
            shared_params=vocab * e if m.tied_embeddings else 0,
            matmul_flops_per_token=2.0 * (proj + vocab * e),
            # A folded final norm's, then the gradient of the head's input (or, with
            # the loss recomputed per chunk, that input itself).
            act_fp32_elems_per_token_whole=(_norm_saved(m) if norm else 0.0) + e,
            act_cast_elems_per_token_whole=float(h if proj else 0),
            act_norm_out_elems_per_token_whole=float(h if proj else 0),
            loss_vocab_rows=vocab,
            loss_width=e,
        )
    )
    return tuple(layers)
