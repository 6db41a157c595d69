"""The bottom of the workers' side: what ``runtime``, ``runfiles``, ``ckpt`` and ``peer``
all stand on, so that each of them only imports down.

- ``records``    what a worker leaves for the launcher: its boot mark, its failure
  record, and the prefixes of the log lines the launcher reads;
- ``stepfiles``  the names in a checkpoint step directory (``ckpt`` writes and reads
  them, ``peer`` copies them);
- ``paramnames`` full parameter names, ``layers.<i>.<name>`` (the model seam's, and
  the keys of a checkpoint);
- ``exiting``    the worker's and the agent's exit without the final garbage
  collections of torch's heap.

Pure and light (no torch): ``runtime.agent`` imports ``records`` inside torchrun's
agent.
"""
