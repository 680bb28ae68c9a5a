"""Loading vLLM's `fp8` checkpoints: the format's name, its E4M3 range against the device's,
and the weight and scale loaders of (fused, tensor-parallel) FP8 linear layers.

On Gaudi 2 the E4M3 range ends at 240, not 448: checkpoint weights are halved into that range as
they load and their scales doubled (`_device_range_factor`), a power of two that keeps every
weight's value (Intel's plugin does the same). Used by `methods/fp8.py` (the linear method),
`methods/fp8_moe.py` (the experts) and `methods/compressed_tensors.py` (which also moves the KV
cache's k/v scales, `kv_range_factor`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import Parameter
from vllm.distributed import get_tensor_model_parallel_rank

from vllm_gaudi_platform.seam import backend
from vllm_gaudi_quant.methods.fp8_linear import FP8_DTYPE

NAME = "fp8"
# The E4M3 range checkpoints are written in (448, the OCP/NVIDIA range).
CHECKPOINT_FP8_MAX = 448.0


# ----------------------------------------------------------------------------- loading
def _device_range_factor() -> float:
    """What checkpoint weights are divided by (and their scales multiplied by) to fit the
    device's E4M3 range: the smallest power of two at least the checkpoint's max over the
    device's, so 1 on Gaudi 3 and 2 on Gaudi 2 (448 / 240 rounded up). A power of two moves
    FP8 values exactly (the subnormals' lowest bit aside); 448 / 240 itself re-rounded about 90%
    of the weights. Intel's vllm-gaudi halves FP8 weights and doubles their scales on Gaudi 2."""
    ratio = CHECKPOINT_FP8_MAX / backend().fp8_max(FP8_DTYPE)
    return 1.0 if ratio <= 1.0 else float(2 ** math.ceil(math.log2(ratio)))


def kv_range_factor() -> float:
    """What a checkpoint's KV-cache k/v scales are multiplied by on this device: the
    checkpoint's E4M3 max over the device's (448 / 240 on Gaudi 2). No stored value is re-rounded
    (the cache is quantized with the moved scale), so the ratio itself is used, as Intel's
    compressed-tensors KV method does."""
    return CHECKPOINT_FP8_MAX / backend().fp8_max(FP8_DTYPE)


def _into_device_range(loaded: torch.Tensor) -> torch.Tensor:
    factor = _device_range_factor()
    if factor == 1.0 or loaded.dtype != FP8_DTYPE:
        return loaded
    return (loaded.float() / factor).to(FP8_DTYPE)


def _shard_index(shard_id: Any, shard_count: int) -> int | None:
    """vLLM's shard id of a fused layer (0/1 for gate/up, "q"/"k"/"v") as an index."""
    if shard_id is None:
        return None
    index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
    if not isinstance(index, int) or not 0 <= index < shard_count:
        raise ValueError(f"fp8 checkpoint: unexpected shard id {shard_id!r}")
    return index


class _ShardedRows:
    """Where each shard of a (possibly fused, tensor-parallel) linear's output rows lives."""

    def __init__(self, output_partition_sizes: list[int], output_split: bool) -> None:
        self.sizes = list(output_partition_sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.output_split = output_split

    def span(self, shard_id: Any) -> tuple[int, int]:
        index = _shard_index(shard_id, len(self.sizes))
        if index is None:
            return 0, sum(self.sizes)
        return self.offsets[index], self.sizes[index]

    def local(self, values: torch.Tensor, size: int, block: int = 1) -> torch.Tensor:
        """This rank's part of a checkpoint vector/matrix along dim 0 (`size` local rows)."""
        if values.shape[0] == size or not self.output_split:
            return values[:size]
        start = get_tensor_model_parallel_rank() * size
        return values.narrow(0, start, size)


def _channel_scale_loader(rows: _ShardedRows):
    """Loads `weight_scale` per tensor (a scalar per shard, spread over its rows) or per channel
    (a vector of the shard's rows) into one float32 scale per output row."""

    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        offset, size = rows.span(shard_id)
        values = loaded_weight.float().reshape(-1) * _device_range_factor()
        target = param.data.narrow(0, offset, size)
        if values.numel() == 1:
            target.fill_(values.item())
        else:
            target.copy_(rows.local(values, size))

    return load


def _input_scale_loader(rows: _ShardedRows):
    """Loads static `input_scale` scalars, one slot per shard (all slots for an unfused one)."""

    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        index = _shard_index(shard_id, len(rows.sizes))
        # In a narrower device range the same activations need a proportionally larger scale.
        value = loaded_weight.float().reshape(-1).max() * _device_range_factor()
        if index is None:
            param.data.fill_(value)
        else:
            param.data[index] = value

    return load


def _block_scale_loader(rows: _ShardedRows, block: tuple[int, int], input_split: bool):
    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        offset, size = rows.span(shard_id)
        bn = block[0]
        if offset % bn or (shard_id is not None and size % bn):
            raise ValueError(
                f"fp8 checkpoint: a fused shard of {size} rows at row {offset} does not align "
                f"with weight_block_size {list(block)}"
            )
        local_rows = -(-size // bn)
        values = rows.local(loaded_weight.float(), local_rows)
        cols = param.shape[1]
        if input_split and values.shape[1] != cols:
            values = values.narrow(1, get_tensor_model_parallel_rank() * cols, cols)
        param.data[offset // bn : offset // bn + local_rows].copy_(values * _device_range_factor())

    return load


def _wrap_weight_loader(loader):
    # vLLM passes the tensor by keyword `loaded_weight` (FusedMoE.load_weights calls
    # `param.weight_loader(param=..., loaded_weight=..., ...)`), so the name must match.
    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return loader(param, _into_device_range(loaded_weight), *args, **kwargs)

    return load
