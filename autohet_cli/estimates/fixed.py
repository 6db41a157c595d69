"""Fixed costs of a step: what it spends per op, per message and per step (pure).

The analytic model's arithmetic and bytes alone predict a small model as nearly
free (the demo's llama-tiny step at TP 2 on the CPU stand-in: 37 ms predicted,
316 ms measured on a quiet machine, 420-880 ms on a busy one). What it missed
costs the same whatever the tensor sizes: each eager op's dispatch
(``FixedCosts.op_us``, more under DTensor: ``tp_op_us``), each collective message
(``hop_us``) and the trainer's own loop (``step_us``). This module counts the ops
and messages; the per-device figures come from the catalog (``catalog.FixedCosts``)
or, once measured, from the profile.

Op counts per layer are those of the probe's shards (the runtime's layers compute
the same), counted with a ``TorchDispatchMode`` on torch 2.13, forward and
backward of one micro-batch:

================================  =======  ========
layer                             forward  backward
================================  =======  ========
block, LayerNorm, learned pos.    38       64
block, RMSNorm                    +12      +30
block, rotary embeddings          +23      +14
block, gated MLP                  +2       +3
block, biases                     +2       +12
embedding                         1        5
final norm (RMSNorm; LayerNorm)   7; 1     22; 7
head (projection + loss)          9        15
================================  =======  ========

TP collectives per layer and pass (Megatron's split, as ``probe._comm_plan``
times them): a block all-reduces after attention and after the MLP, and both
again in backward; a vocab-parallel embedding reduces its partial lookups once;
the vocab-parallel loss reduces its max, sum and target logit, and the head's
input gradient once in backward.

Below the cost model (which charges collectives' latency and the step's fixed
cost with it) and beside the analytic estimates (which add each layer's dispatch
time): both read it, so it sits under both; ``costmodel.fixed`` re-exports it.
"""

from __future__ import annotations

import math

from autohet_cli.catalog import FixedCosts
from autohet_cli.models import LayerSpec, ModelSpec

# (forward, backward) all-reduces of one TP shard per micro-batch, by layer kind
TP_COLLECTIVES = {"block": (2, 2), "embedding": (1, 0), "head": (3, 1), "norm": (0, 0)}
# the world all-reduces of every step: the gradient norm and the loss/memory report
STEP_COLLECTIVES = 2


def layer_ops(layer: LayerSpec, model: ModelSpec) -> tuple[int, int]:
    """Eager ops of one micro-batch through ``layer``: (forward, backward)."""
    rms = model.norm == "rmsnorm"
    if layer.kind == "block":
        fwd, bwd = 38, 64
        if rms:
            fwd, bwd = fwd + 12, bwd + 30
        if model.num_positions == 0:  # rotary embeddings in the attention
            fwd, bwd = fwd + 23, bwd + 14
        if model.gated_mlp:
            fwd, bwd = fwd + 2, bwd + 3
        if model.bias:
            fwd, bwd = fwd + 2, bwd + 12
        return fwd, bwd
    if layer.kind == "embedding":
        return 1, 5
    if layer.kind == "norm":
        return (7, 22) if rms else (1, 7)
    return 9, 15  # head: projection, cross-entropy


def param_tensors(layer: LayerSpec, model: ModelSpec) -> int:
    """Parameter tensors of ``layer`` (what the optimizer and the clip loop visit)."""
    norm = 1 if model.norm == "rmsnorm" else 2  # weight (and bias)
    if layer.kind == "block":
        linears = 4 + (3 if model.gated_mlp else 2)  # q, k, v, o and the MLP
        return 2 * norm + linears * (2 if model.bias else 1)
    if layer.kind == "embedding":
        return 1 + (1 if model.num_positions else 0)
    if layer.kind == "norm":
        return norm
    return 1  # head: the projection (a final norm inside it is its own layer or tiny)


def dispatch_ms(fixed: FixedCosts, num_ops: float, tp: int, op_us: float | None = None) -> float:
    """Host time of ``num_ops`` eager ops at TP degree ``tp`` (``op_us``: a measured
    per-op time that replaces the catalog's)."""
    per_op = fixed.op_us if op_us is None else op_us
    if tp > 1:
        per_op += fixed.tp_op_us
    return num_ops * per_op / 1e3


def with_dispatch(fixed: FixedCosts, work_ms: float, host_ms: float) -> float:
    """A layer's time from its device work and its ops' host time: the longer of the
    two where launches run ahead of the device, else their sum."""
    return max(work_ms, host_ms) if fixed.overlapped else work_ms + host_ms


def ring_latency_ms(hop_ms: float, participants: int) -> float:
    """Latency of a ring all-reduce: 2(n-1) messages one after the other."""
    return 0.0 if participants <= 1 else 2 * (participants - 1) * hop_ms


def small_allreduce_ms(hop_ms: float, participants: int) -> float:
    """A small all-reduce over ``participants`` ranks (a tree, or recursive doubling:
    up and down ceil(log2 n) levels): what the step's norm and report cost."""
    return 0.0 if participants <= 1 else 2 * math.ceil(math.log2(participants)) * hop_ms


def step_ms(loop_ms: float, hop_ms: float, world: int) -> float:
    """The fixed per-step cost outside the stages: the trainer's loop (``loop_ms``,
    ``FixedCosts.step_us`` or measured) and the step's world all-reduces."""
    return loop_ms + STEP_COLLECTIVES * small_allreduce_ms(hop_ms, world)
