"""Stage boundaries travel in the communication dtype between two real gloo processes
(the decision's cost-model half is ``tests/unit/test_comm_dtype.py``)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autohet_cli.runtime.pipeline import P2P, RESIDUAL_DTYPE

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exchange(rank: int, port: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        p2p = P2P(
            prev_rank=0 if rank == 1 else None,
            next_rank=1 if rank == 0 else None,
            shape=(4,),
            device=torch.device("cpu"),
            dtype=torch.bfloat16,
        )
        value = torch.tensor([1.0 + 2**-10, 3.14159265, -2.5, 1e-3], dtype=torch.float32)
        if rank == 0:
            p2p.send_forward(value)
            grad = p2p.recv_backward()
            assert grad is not None
            queue.put(("grad", grad.dtype, grad.tolist()))
        else:
            got = p2p.recv_forward()
            assert got is not None
            queue.put(("act", got.dtype, got.tolist()))
            p2p.send_backward(got * 2)
    finally:
        dist.destroy_process_group()


def test_stage_boundaries_travel_in_the_comm_dtype_and_arrive_widened() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_exchange, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = {kind: (dtype, values) for kind, dtype, values in (queue.get(), queue.get())}
    sent = torch.tensor([1.0 + 2**-10, 3.14159265, -2.5, 1e-3])
    wire = sent.to(torch.bfloat16).to(torch.float32)
    assert wire[0] != sent[0]  # bf16 drops the bit: the value did travel in bf16
    assert got["act"] == (RESIDUAL_DTYPE, wire.tolist())
    assert got["grad"] == (RESIDUAL_DTYPE, (wire * 2).to(torch.bfloat16).float().tolist())
