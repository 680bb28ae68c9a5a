"""The wire of the HPU weight-transfer engine, shared by the trainer and the engine's workers.

One process group joins the trainer (rank 0, which also hosts the rendezvous store) and every
inference worker (ranks 1..N: data-parallel replica, then tensor-parallel rank). It is a gloo
group built straight from a TCPStore, outside torch.distributed's default group, so the workers'
own tensor-parallel group is not touched and the trainer needs no vLLM. Tensors cross it as host
bytes: on a Gaudi the worker copies them from host memory into the device parameters (a
device-to-device HCCL group between two independent processes is not built here; how Habana's
bridge builds one outside the default group is not established from its sources).

One update round, all broadcasts from rank 0:

1. a head, int64 `[MAGIC, PROTOCOL, len(meta), round]`;
2. the metadata, UTF-8 JSON `{"params": [[name, dtype, shape], ...], "buckets": [[first, end,
   nbytes], ...]}`: the tensors in send order and how they are packed (a bucket holds the
   tensors `first..end-1`, each starting at a multiple of ALIGN bytes);
3. each bucket, uint8;
4. a tail, int64 `[MAGIC_END, round]`: the trainer finished the round.

The workers write nothing into the model before the tail has arrived, so a trainer that dies or
stalls mid-round leaves the old weights serving (the broadcast fails at the group's timeout, or
at once when the trainer's sockets close).

Only torch is imported here: a training script imports this module without vLLM.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

MAGIC = 0x48505557  # "HPUW"
MAGIC_END = 0x454E4457  # "ENDW"
PROTOCOL = 1
ALIGN = 64  # byte offset of every tensor in a bucket: any dtype's view of it is aligned
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 300.0
STORE_PREFIX = "vllm-gaudi-weights"

# The dtypes a round may carry (names as `str(torch.dtype)` without "torch.").
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(
            f"weight transfer: dtype {dtype} is not sent (supported: {', '.join(DTYPES)}); "
            "cast the tensor before sending"
        )
    return name


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class RoundPlan:
    params: list[ParamSpec]
    buckets: list[tuple[int, int, int]]  # (first, end, nbytes)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "params": [[p.name, p.dtype, list(p.shape)] for p in self.params],
                "buckets": [list(b) for b in self.buckets],
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RoundPlan:
        data = json.loads(raw.decode())
        params = [ParamSpec(n, d, tuple(int(x) for x in s)) for n, d, s in data["params"]]
        for p in params:
            if p.dtype not in DTYPES:
                raise ValueError(f"weight transfer: tensor {p.name!r} has unknown dtype {p.dtype}")
        buckets = [(int(a), int(b), int(c)) for a, b, c in data["buckets"]]
        plan = cls(params, buckets)
        plan.check()
        return plan

    def check(self) -> None:
        """The buckets cover the tensors in order, each with the bytes its tensors need."""
        expected = 0
        for first, end, nbytes in self.buckets:
            if first != expected or end <= first or end > len(self.params):
                raise ValueError(f"weight transfer: malformed bucket [{first}, {end})")
            if nbytes != packed_size(self.params[first:end]):
                raise ValueError(f"weight transfer: bucket [{first}, {end}) size {nbytes} is wrong")
            expected = end
        if expected != len(self.params):
            raise ValueError("weight transfer: the buckets do not cover every tensor")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed_size(params: Sequence[ParamSpec]) -> int:
    total = 0
    for p in params:
        total = _aligned(total) + p.nbytes
    return total


def plan_round(params: Sequence[ParamSpec], bucket_bytes: int) -> RoundPlan:
    """Buckets of consecutive tensors up to `bucket_bytes` each (a larger tensor goes alone);
    `bucket_bytes=0` sends one tensor per bucket."""
    buckets: list[tuple[int, int, int]] = []
    first = 0
    for i in range(1, len(params) + 1):
        close = i == len(params)
        if not close and bucket_bytes > 0:
            close = packed_size(params[first : i + 1]) > bucket_bytes
        elif not close:
            close = True
        if close:
            buckets.append((first, i, packed_size(params[first:i])))
            first = i
    return RoundPlan(list(params), buckets)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Host uint8 bytes of `tensors` laid out as `unpack` reads them."""
    specs = [ParamSpec("", dtype_name(t.dtype), tuple(t.shape)) for t in tensors]
    out = torch.zeros(packed_size(specs), dtype=torch.uint8)
    offset = 0
    for t in tensors:
        offset = _aligned(offset)
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    return out


def unpack(buffer: torch.Tensor, params: Sequence[ParamSpec]) -> Iterator[torch.Tensor]:
    """Views of `buffer` (from `pack`) as the tensors of `params`."""
    offset = 0
    for p in params:
        offset = _aligned(offset)
        raw = buffer[offset : offset + p.nbytes]
        offset += p.nbytes
        yield raw.view(DTYPES[p.dtype]).reshape(p.shape)


class WireGroup:
    """The trainer-and-workers gloo group: rank 0 is the trainer."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        if world_size < 2:
            raise ValueError(
                f"weight transfer: world_size={world_size}; it counts the trainer and every "
                "inference worker (1 + data_parallel_size * tensor_parallel_size * "
                "pipeline_parallel_size)"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"weight transfer: rank {rank} outside world_size={world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        # Any: torch's stubs omit the collectives of a backend object used directly.
        self.pg: Any = dist.ProcessGroupGloo(
            PrefixStore(STORE_PREFIX, self.store), rank, world_size, timeout
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        # Dropping the references closes the sockets; the store's server (rank 0) stops with it.
        self.pg = None
        self.store = None  # type: ignore[assignment]


def send_round(
    group: WireGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    round_no: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stop_after_buckets: int | None = None,
) -> RoundPlan:
    """Rank 0's side of one round (see the module's docstring). `stop_after_buckets` returns
    before the rest of the buckets and the tail: a test's stand-in for a trainer that dies."""
    tensors = [(name, t.detach()) for name, t in named_tensors]
    specs = [ParamSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors]
    plan = plan_round(specs, bucket_bytes)
    meta = plan.to_json()
    group.broadcast(torch.tensor([MAGIC, PROTOCOL, len(meta), round_no], dtype=torch.int64))
    group.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    for i, (first, end, _) in enumerate(plan.buckets):
        if stop_after_buckets is not None and i >= stop_after_buckets:
            return plan
        group.broadcast(pack([t for _, t in tensors[first:end]]))
    group.broadcast(torch.tensor([MAGIC_END, round_no], dtype=torch.int64))
    return plan


def receive_round(group: WireGroup) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """A worker's side of one round: the round number and every tensor, in host memory, once
    the tail confirmed the trainer sent them all."""
    head = torch.zeros(4, dtype=torch.int64)
    group.broadcast(head)
    magic, protocol, meta_len, round_no = (int(x) for x in head.tolist())
    if magic != MAGIC or protocol != PROTOCOL:
        raise ValueError(
            f"weight transfer: the trainer's head is {magic:#x}/{protocol}, expected "
            f"{MAGIC:#x}/{PROTOCOL}: the trainer does not speak this engine's protocol (is it "
            "vllm_gaudi_platform.distributed.weight_sender of the same release?)"
        )
    meta = torch.zeros(meta_len, dtype=torch.uint8)
    group.broadcast(meta)
    plan = RoundPlan.from_json(bytes(meta.numpy()))
    received: list[tuple[str, torch.Tensor]] = []
    for first, end, nbytes in plan.buckets:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        group.broadcast(buffer)
        specs = plan.params[first:end]
        received.extend((p.name, t) for p, t in zip(specs, unpack(buffer, specs), strict=True))
    tail = torch.zeros(2, dtype=torch.int64)
    group.broadcast(tail)
    if int(tail[0]) != MAGIC_END or int(tail[1]) != round_no:
        raise ValueError(f"weight transfer: round {round_no} ended with a malformed tail")
    return round_no, received
