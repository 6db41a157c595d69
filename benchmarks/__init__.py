"""Benchmarks that print figures (not tests): ``python -m benchmarks [NAME ...]``.

- ``megatron_check``: the cost model against Megatron-LM's published throughput
  (Narayanan et al., SC'21, Table 1) on homogeneous A100-80 clusters.
- ``planner_speed``: planner wall time from 16 to 1024 GPUs.
- ``planner_quality``: our plans' tokens/s against the baselines on mixed clusters
  with Sailor's measured profiles.
- ``metis_neo``: GPT-Neo-2.7B on 8 A100-40 + 8 V100-16 against the Metis plan
  (TP degree per GPU type against one degree).
- ``opt30b``: OPT-30B where memory binds, by default, with ZeRO-1 and with
  recomputation.
- ``profile_hosts``: `autohet profile run` on 3 real-sshd loopback hosts, serial vs
  parallel.
- ``runtime_overhead``: the worker runtime's step time against torch DDP and
  ``Schedule1F1B`` (2 gloo processes on CPU, gpt-small).
- ``llama_runtime``: tokens/s of the runtime training a small LLaMA on one CPU
  device against a plain single-process torch loop of the same model.
- ``comm_dtype``: predicted iteration time with the gradient all-reduce charged in
  bf16 (2 bytes/parameter, the old charge) versus fp32 (4, settings.py), on fast and
  slow (5 Gbit/s) links, for fixed plans and for the planner's own picks.
- ``predictions``: predicted against measured step time and memory for six plan
  shapes of gpt-small and llama-tiny on localhost, before and after calibration.
- ``recovery_time``: the shard-transfer phase of recovery, local-first vs remote-only.
- ``recovery_e2e``: recovery end to end on 3 sshd hosts, from a SIGKILLed host to the
  first resumed step (detect, replan, transfer, restart, load), against restarting
  from remote storage only (read at ``AUTOHET_BENCH_REMOTE_MBPS``, default 300 MB/s),
  for gpt-small and a ~200M llama (``AUTOHET_BENCH_SIZES=toy,200m``, the default), with
  a projection of both ways to a 15 GB checkpoint on real links.
- ``peer_link``: one pair of hosts (two loopback addresses), a 1.5 GB shard copied
  by the script recover runs there (serve, fetch: hashed as it lands), against a
  plain write of the same bytes into a new file.
- ``recovery_disk``: the 200M llama on one CPU device, 2.4 GB per save: blocked,
  persisted, load and kill-to-first-step against a plain write of the same bytes
  (also ``AUTOHET_BENCH_SIZES=200m-disk`` of ``recovery_e2e``).
- ``gpu_predictions``: the same on this machine's CUDA GPUs in bf16 (GPT-1.3B by
  default; skipped without a GPU).
- ``gpu_throughput``: on this machine's GPU, the runtime (the planner's plan,
  torch.compile per block, chunked loss) against HF ``LlamaForCausalLM`` eager and
  compiled on the 1.2B llama: tokens/s, MFU, peak memory, and the plan's analytic
  memory against the measured peak (skipped without a GPU).
- ``fsdp_memory``: weight-sharded stages on the CPU, P = 1, 2, 4 holders of a 57.7M
  gpt2: the state each rank holds, measured, against the memory model's 1/P term.
"""

BENCHMARKS = (
    "megatron_check",
    "planner_speed",
    "planner_quality",
    "metis_neo",
    "opt30b",
    "profile_hosts",
    "runtime_overhead",
    "llama_runtime",
    "recovery_time",
    "recovery_e2e",
    "recovery_disk",
    "peer_link",
    "comm_dtype",
    "predictions",
    "gpu_predictions",
    "gpu_throughput",
    "fsdp_memory",
)
