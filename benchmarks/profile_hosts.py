"""How long `autohet profile run` takes on 3 hosts, one at a time vs in parallel.

Three real sshd "hosts" on loopback (127.0.0.2-4, the e2e test fixtures), each
profiled for gpt-tiny on its CPU. All three share this machine's 2 cores, so
the parallel speed-up is bounded by the cores, not by the network: on real
hosts each probe has its own machine and the parallel time approaches the
slowest host's. Median of 3 runs each.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

from autohet_cli.cluster import Cluster
from autohet_cli.models import get_model
from autohet_cli.profiling.run import ProfileRunRequest, run_profiling
from benchmarks._sshd import sshd_farm, sshd_missing

REPEATS = 3


def main() -> None:
    if sshd_missing():
        return
    with sshd_farm() as (_, farm):
        farm.start(3)
        hosts = tuple(h.as_host(python=sys.executable) for h in farm.hosts)
        req = ProfileRunRequest(
            cluster=Cluster(name="bench", hosts=hosts, inter_node_gbps=10.0),
            model=get_model("gpt-tiny"),
            seq_len=64,
            tps=(1,),
            micro_batch_sizes=(1, 2),
            all_hosts=True,
            timeout_s=300,
            known_hosts=farm.known_hosts,
            time_budget_s=2.0,
            measure_network=False,
        )
        rows = []
        for label, parallel in (("serial", 1), ("parallel", 3)):
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                result = run_profiling(replace(req, max_parallel=parallel))
                times.append(time.perf_counter() - start)
                assert not result.failed, [o.error for o in result.failed]
            rows.append((label, statistics.median(times), min(times), max(times)))
    print(f"{'mode':10} {'median s':>9} {'min s':>7} {'max s':>7}")
    for label, med, lo, hi in rows:
        print(f"{label:10} {med:9.1f} {lo:7.1f} {hi:7.1f}")
    print(f"speed-up parallel/serial: {rows[0][1] / rows[1][1]:.2f}x (3 hosts on 2 shared cores)")
