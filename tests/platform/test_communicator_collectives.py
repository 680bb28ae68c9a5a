"""HPUCommunicator's variable-size collectives (the MoE token exchange between data-parallel
ranks) on two gloo processes, against what each rank must receive."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
SIZES = [3, 5]  # tokens per rank: unequal, as vLLM allows between DP ranks


def _rank_tensor(rank: int, rows: int) -> torch.Tensor:
    return torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 100 * (rank + 1)


def _worker(rank: int, port: int, results) -> None:
    os.environ["VLLM_HPU_EMULATION"] = "cpu"
    import torch.distributed as dist

    from vllm_gaudi_platform.communicator import HPUCommunicator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    comm = HPUCommunicator(group, torch.device("cpu"), group, unique_name="dp:0")
    mine = _rank_tensor(rank, SIZES[rank])
    gathered = comm.all_gatherv([mine, mine[:, :1].clone()], dim=0, sizes=SIZES)
    full = torch.cat([_rank_tensor(r, SIZES[r]) for r in range(WORLD)])
    # reduce_scatterv: every rank holds a full-size tensor; each keeps the sum of its own rows.
    scattered = comm.reduce_scatterv(full * (rank + 1), dim=0, sizes=SIZES)
    results[rank] = (gathered[0], gathered[1], scattered)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        shared = manager.dict()
        procs = [ctx.Process(target=_worker, args=(r, port, shared)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return dict(shared)


@pytest.mark.process
def test_all_gatherv_concatenates_every_ranks_rows_in_rank_order(results):
    full = torch.cat([_rank_tensor(r, SIZES[r]) for r in range(WORLD)])
    for rank in range(WORLD):
        hidden, first_column, _ = results[rank]
        torch.testing.assert_close(hidden, full)
        torch.testing.assert_close(first_column, full[:, :1])


@pytest.mark.process
def test_reduce_scatterv_gives_each_rank_the_sum_of_its_own_rows(results):
    full = torch.cat([_rank_tensor(r, SIZES[r]) for r in range(WORLD)])
    summed = full * sum(r + 1 for r in range(WORLD))
    starts = [0, SIZES[0]]
    for rank in range(WORLD):
        expected = summed[starts[rank] : starts[rank] + SIZES[rank]]
        torch.testing.assert_close(results[rank][2], expected)
