"""autohet probe: time a model's layers on this host's accelerator (self-contained).

``autohet profile run`` packs this package into one zipapp (``probepack``), copies
that one file to each host and runs

    python probe.pyz --spec spec.json --out result.json

(or ``python -m autohet_cli.profiling.probe`` where autohet is installed). Its
modules import only the standard library, torch and each other (relatively), so
that it runs on any host with torch, autohet installed or not.

The spec (``autohet.probe-spec/v1``, written by ``autohet_cli.profiling.measure``)
gives the shapes of each distinct kind of partitionable layer (embedding, block,
final norm, head), the sequence length, the tensor-parallel degrees and micro-batch
sizes to measure, the dtype, warmup/repeat counts and a time budget. The result
(``autohet.probe-result/v1``) holds:

- host facts and the accelerator inventory (torch, and nvidia-smi when present);
  without a GPU the CPU is one device of type ``cpu`` with min(RAM/2, 8 GiB);
- square-GEMM TFLOP/s at the training dtype and copy bandwidth GB/s (medians);
- per TP degree t > 1, all-reduce milliseconds for each message size the layers
  send: a real all-reduce between t local processes (NCCL over t GPUs, gloo on
  the CPU) when possible, else estimated from the copy bandwidth (and it says so);
- per (t, micro-batch size) and layer kind: forward and backward ms of one TP
  rank's shard (heads/t, ffn/t, vocab/t; Megatron column/row split) plus that
  kind's TP all-reduces, the shard's parameters, the bytes it keeps for backward
  (unique storages seen by ``saved_tensors_hooks``, parameters excluded) and the
  bytes it sends on; ``oom`` where it ran out of memory;
- per (t, layer kind), the Adam step on fp32 master weights in ms;
- a training iteration over 1, 2 and 4 norm layers, for ``fixedfit`` to fit what an
  iteration costs beyond its layers (the loss, the clip, the optimizer's launches).

Times are medians; repeats drop (never below one) to stay within the budget.
Runs on Python >= 3.8 with torch >= 2.0, whatever the host has: no syntax newer
than 3.8 (``tests/unit/test_probe.py`` checks it).

One job per module, each importing only those below it:

- ``spec``: the spec's check and defaults, the schemas and ``PROBE_VERSION``;
- ``host``: host facts, the GPU inventory, the device and dtype to use;
- ``timing``: the time budget and the median of repeated runs;
- ``rates``: GEMM TFLOP/s, copy bandwidth, GPU-to-GPU copy;
- ``loss``: the copy of the runtime's chunked head loss;
- ``shards``: one TP rank's shard of each layer kind;
- ``memory``: bytes kept for backward, peak estimates, out-of-memory;
- ``comm``: the TP all-reduces, measured or estimated;
- ``layers``: forward and backward of one shard, plain and recomputed;
- ``update``: the Adam step;
- ``fixed``: an iteration's cost beyond its layers;
- ``kinds``: each kind at each TP degree and micro-batch size, within the budget;
- ``driver``: the whole run, as the result;
- ``cli``: the command line (``__main__``).

This file imports nothing, so that ``spec`` can be used without loading torch.
"""
