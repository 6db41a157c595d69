"""One folder per run: what a launch leaves, and how `autohet runs` reads it back.

``runs/<plan>.v<N>/<run id>/`` in the directory the launch ran from holds:

- ``<host>.log`` and ``events.json``: every host's output and how the run ended;
- ``metrics.jsonl`` and ``tensorboard/``: rank 0's per-step figures (``metricsfile``);
- ``prediction-check.json`` (and ``run-report.json``): the run against its plan;
- ``run.json``: the run record (``record``): plan, cluster, job, status, last step and
  loss, where the checkpoints are, start and end;
- ``loss.png``: written by ``autohet runs show``.

None of them imports torch: ``runs`` stays fast, and ``plot`` imports matplotlib only
to draw a PNG.
"""
