"""Inter-host bandwidth: a short torch.distributed all-reduce between two hosts.

Self-contained (standard library + torch) so it can be copied to a host and
run as ``python netprobe.py`` with the torchrun-style environment RANK,
WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT. Rank 0 prints one JSON line with the
bus bandwidth (for two ranks a ring all-reduce moves the message once each way,
so Gbit/s = 8 * bytes / seconds / 1e9) per message size and the best of them.
NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time


def main() -> int:
    import torch
    import torch.distributed as dist

    sizes_mb = [int(x) for x in os.environ.get("AUTOHET_NET_SIZES_MB", "1,4,16").split(",")]
    repeat = int(os.environ.get("AUTOHET_NET_REPEAT", "5"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for mb in sizes_mb:
        x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections, buffers
        times = []
        for _ in range(repeat):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results[str(mb)] = 8 * x.numel() * 4 / seconds / 1e9
    dist.barrier()
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "gbps_by_mb": results,
                    "gbps": max(results.values()),
                    "backend": dist.get_backend(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
