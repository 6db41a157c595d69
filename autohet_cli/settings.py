"""Training settings shared by the cost model, the planner and the plan artifact (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from autohet_cli.errors import ConfigError
from autohet_cli.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, at_most

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "sgd")

# Bytes of state per parameter: weights + gradients + optimizer state. Mixed
# precision keeps fp32 master weights beside the 16-bit ones (ZeRO paper, K=12+4).
_STATE_BYTES = {
    ("bf16", "adam"): 16,
    ("fp16", "adam"): 16,
    ("fp32", "adam"): 16,
    ("bf16", "sgd"): 12,
    ("fp16", "sgd"): 12,
    ("fp32", "sgd"): 12,
}


# Communication dtypes: the one decision the cost model charges and the runtime runs.
# - Stage-to-stage activations (and their gradients, sent back) travel in the compute
#   dtype: 2 bytes under bf16/fp16, as Megatron-LM's pipeline sends them. The receiver
#   widens them to fp32 again, so the residual stream stays fp32 like one process.
# - Data-parallel gradient all-reduce runs in fp32 (4 bytes per parameter) on the fp32
#   gradients of fp32 master weights, as Megatron-LM's accumulate_allreduce_grads_in_fp32
#   (forced on for bf16) and torchtitan's reduce_dtype=float32 do: summing 16-bit
#   gradients over many replicas loses their low bits, and our replicas are uneven.
# - TP all-reduces inside a layer run on autocast outputs: the compute dtype.
# On a CPU the runtime computes, and so communicates, in fp32 whatever the plan says.
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
GRAD_REDUCE_DTYPE = "float32"
GRAD_REDUCE_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSettings:
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adam"
    # ZeRO-1: optimizer state sharded over the pipelines that hold the same layers
    # (runtime.zero); written to plans only when true.
    zero1: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("global_batch_size", "micro_batch_size"):
            at_most(
                getattr(self, name),
                MAX_GLOBAL_BATCH,
                f"training.{name}",
                "published runs take at most ~64k samples per step",
            )
        at_most(
            self.seq_len, MAX_SEQ_LEN, "training.seq_len", "the longest contexts are ~10M tokens"
        )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"training.precision: expected one of {', '.join(PRECISIONS)}, "
                f"got {self.precision!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"training.optimizer: expected one of {', '.join(OPTIMIZERS)}, "
                f"got {self.optimizer!r}"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes of an activation, and of one sent between stages or inside TP."""
        return 4 if self.precision == "fp32" else 2

    @property
    def state_bytes_per_param(self) -> int:
        return _STATE_BYTES[(self.precision, self.optimizer)]

    @property
    def optimizer_bytes_per_param(self) -> int:
        """The optimizer's own state in ``state_bytes_per_param``: Adam's two fp32
        moments, SGD's fp32 momentum (what ZeRO-1 shards)."""
        return 8 if self.optimizer == "adam" else 4

    @property
    def grad_bytes_per_param(self) -> int:
        """What the data-parallel all-reduce moves per parameter (fp32, see above)."""
        return GRAD_REDUCE_BYTES

    @property
    def num_microbatches_total(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.seq_len
