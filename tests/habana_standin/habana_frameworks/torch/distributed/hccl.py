"""The torch.distributed backend "hccl", as far as vLLM's tensor parallelism uses it.

Fact (Intel's vllm-gaudi: its worker imports only `habana_frameworks.torch` before
`init_distributed_environment(..., backend="hccl")` and checks the group with an `all_reduce` of a
tensor on "hpu"): importing Habana's package registers the backend "hccl", whose collectives take
device tensors. The stand-in's group runs each collective over a gloo group built from the same
store, staging the device tensors through host memory (every staged read is counted by the
stand-in device as a device-to-host read).

Strict where HCCL's behaviour is not established here: only tensors on the torch device "hpu"
are taken (a host tensor is refused naming the collective; vLLM keeps host tensors on its gloo
"cpu group"), and only the collectives vLLM's device communicators call (all_reduce, all_gather,
all_gather_into_tensor, reduce_scatter_tensor, broadcast, barrier) exist; any other is refused.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

NAME = "hccl"


class _Done(dist.distributed_c10d.Work):
    """A collective that completed before it was returned (the host staging is synchronous)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


def _device_tensors(op: str, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "hpu":
            raise RuntimeError(
                f"hccl {op}: tensors must be on the HPU device, got one on {t.device} of shape "
                f"{tuple(t.shape)} (host tensors go over a gloo group)"
            )


# Every live group by number: the collectives are torch ops (below) that name their group.
_GROUPS: dict[int, ProcessGroupHCCL] = {}


def _reduce_options(op: int) -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.RedOpType(op))
    return options


# Each collective is a device op (a torch custom op on the group's device tensors), so an HPU
# graph captured around it records it and every replay runs it again, as a Gaudi's graph replays
# its HCCL collectives (Intel's vllm-gaudi runs tensor parallelism inside HPU graphs). The body
# stages the tensors through the host and runs gloo.
@torch.library.custom_op("hccl_standin::all_reduce_", mutates_args=("tensor",))
def _all_reduce(tensor: torch.Tensor, group: int, op: int) -> None:
    host = tensor.cpu()
    _GROUPS[group]._gloo.allreduce([host], _reduce_options(op)).wait()
    tensor.copy_(host)


@torch.library.custom_op("hccl_standin::all_gather_", mutates_args=("outputs",))
def _all_gather(outputs: list[torch.Tensor], input: torch.Tensor, group: int) -> None:
    host_in = input.cpu()
    host_out = [torch.empty_like(host_in) for _ in outputs]
    _GROUPS[group]._gloo.allgather([host_out], [host_in]).wait()
    for t, h in zip(outputs, host_out, strict=True):
        t.copy_(h)


@torch.library.custom_op("hccl_standin::all_gather_into_tensor_", mutates_args=("output",))
def _all_gather_into(output: torch.Tensor, input: torch.Tensor, group: int) -> None:
    host_out = torch.empty(output.shape, dtype=output.dtype)
    _GROUPS[group]._gloo._allgather_base(host_out, input.cpu()).wait()
    output.copy_(host_out)


@torch.library.custom_op("hccl_standin::reduce_scatter_tensor_", mutates_args=("output",))
def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: int, op: int) -> None:
    # gloo has no reduce-scatter of one tensor: all_reduce the whole, keep this rank's part.
    pg = _GROUPS[group]
    host = input.cpu()
    pg._gloo.allreduce([host], _reduce_options(op)).wait()
    output.copy_(host.chunk(pg.size())[pg.rank()])


@torch.library.custom_op("hccl_standin::broadcast_", mutates_args=("tensor",))
def _broadcast(tensor: torch.Tensor, group: int, root: int) -> None:
    host = tensor.cpu()
    options = dist.BroadcastOptions()
    options.rootRank = root
    _GROUPS[group]._gloo.broadcast([host], options).wait()
    tensor.copy_(host)


for _op in (_all_reduce, _all_gather, _all_gather_into, _reduce_scatter, _broadcast):
    _op.register_fake(lambda *args, **kwargs: None)


def _op_code(opts: Any) -> int:
    return int(opts.reduceOp.op) if opts is not None else int(dist.ReduceOp.SUM)


class ProcessGroupHCCL(ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._number = len(_GROUPS)
        _GROUPS[self._number] = self
        self._group_name = self._group_desc = ""

    def name(self) -> str:
        return NAME

    # torch.distributed names every group it makes (and looks groups up by name to destroy them);
    # a process group of torch's own keeps the name in its C++ backend, which a group written in
    # Python has not, so it keeps the name itself.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def getBackendName(self) -> str:
        return NAME

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        _device_tensors("all_reduce", tensors)
        for t in tensors:
            _all_reduce(t, self._number, _op_code(opts))
        return _Done(tensors)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Done:
        _device_tensors("all_gather", [*inputs, *(t for ts in output_lists for t in ts)])
        for outputs, t in zip(output_lists, inputs, strict=True):
            _all_gather(outputs, t, self._number)
        return _Done(output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:
        _device_tensors("all_gather_into_tensor", [output, input])
        _all_gather_into(output, input, self._number)
        return _Done(output)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Done:
        _device_tensors("reduce_scatter_tensor", [output, input])
        _reduce_scatter(output, input, self._number, _op_code(opts))
        return _Done(output)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        _device_tensors("broadcast", tensors)
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            _broadcast(t, self._number, root)
        return _Done(tensors)

    def barrier(self, opts: Any = None) -> _Done:
        self._gloo.barrier().wait()
        return _Done()


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupHCCL:
    return ProcessGroupHCCL(store, rank, size, timeout)


def register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["hpu"])


register()
