"""Two GPUs, NCCL: a tensor-parallel MLP whose all-reduce is an eager break.

Needs a machine with two CUDA GPUs (the `nvidia-h200-x2` kind); skipped elsewhere. One process
per GPU; `barrier_fn` is a barrier on the group, so both ranks reach the collective break
together at capture; capture runs in `thread_local` mode so NCCL's own threads may call CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

HIDDEN, FFN, BATCH = 256, 1024, 8


def _rank_main(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast stays off on shared hosts
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        w1 = (torch.randn(HIDDEN, FFN, generator=gen) * 0.05).cuda()
        w2 = (torch.randn(FFN, HIDDEN, generator=gen) * 0.05).cuda()
        shard = FFN // world
        w1_r = w1[:, rank * shard : (rank + 1) * shard].contiguous()
        w2_r = w2[rank * shard : (rank + 1) * shard].contiguous()

        @eager_on_graph(strict=True, name="all_reduce")
        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        def tp_mlp(x: torch.Tensor) -> torch.Tensor:
            partial = torch.relu(x @ w1_r) @ w2_r
            all_reduce(partial)
            return partial * 2 + 1

        static_x = torch.randn(BATCH, HIDDEN, generator=gen).cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tp_mlp(static_x)  # warm-up: NCCL communicator and cuBLAS handles
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(
            graph, capture_error_mode="thread_local", barrier_fn=dist.barrier
        ):
            out = tp_mlp(static_x)
        assert graph.break_names == ("all_reduce",) and graph.num_segments == 2
        for _ in range(3):
            new = torch.randn(BATCH, HIDDEN, generator=gen).cuda()  # same on both ranks
            static_x.copy_(new)
            graph.replay()
            expected = (torch.relu(new @ w1) @ w2) * 2 + 1
            torch.cuda.synchronize()
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (the nvidia-h200-x2 device kind)",
)
def test_tensor_parallel_mlp_all_reduce_break(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
