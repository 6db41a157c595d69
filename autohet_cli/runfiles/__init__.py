"""One folder per run: what a launch leaves, and how `autohet runs` reads it back.

``runs/<plan>.v<N>/<run id>/`` in the directory the launch ran from holds:

- ``<host>.log`` and ``events.json``: every host's output and how the run ended;
- ``metrics.jsonl`` and ``tensorboard/``: rank 0's per-step figures (``metricsfile``);
- ``prediction-check.json`` (and ``run-report.json``): the run against its plan;
- ``run.json``: the run record (``record``): plan, cluster, job, the checkpoint step it
  resumed from, status, last step and loss, where the checkpoints are, start and end;
- ``loss.png`` (``job-loss.png``: its job's curve, across runs): written by ``autohet
  runs show`` (``view``).

The runs of one job (a launch, then its resumes and recoveries, under plan versions
of their own) are linked when read (``jobs``), never by rewriting a record.

None of them imports torch: ``runs`` stays fast, and ``plot`` imports matplotlib only
to draw a PNG.
"""
