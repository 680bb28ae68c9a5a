"""Upstream-drift guard: every name of vLLM (and torch, neural-compressor, nixl) the four wheels
write into, override, call or read privately still exists, with the parameters we rely on, in the
installed packages; and every method of every vLLM subclass in the wheels still overrides one of
vLLM's.

Why: an override of a renamed private method is never called, and vLLM raises nothing about it; a
vLLM upgrade would silently lose the HPU behaviour. This test turns that into a failure that names
the method.

The rows are not kept here: each wheel's ledger (`vllm_gaudi_platform.patches` and its siblings,
one module per patch or reliance) carries its own, and the checks are
`vllm_gaudi_platform.patches.drift`. The subclasses are found by walking the wheels; the methods
that are ours alone are declared in the ledgers' `SUBCLASSES`. What stays here: the conventions
checked by example (constructing vLLM's objects), the stand-ins' parameter lists, and the guard's
own tests (each check fails when upstream changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from vllm_gaudi_platform import patches
from vllm_gaudi_platform.patches import drift
from vllm_gaudi_platform.patches.drift import parameter_names, problems_with, resolve

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def ledger_entries() -> list[patches.Patch]:
    return [entry for ledger in patches.installed_ledgers() for entry in patches.entries(ledger)]


def ledger_rows() -> list[tuple[str, patches.Upstream]]:
    return [(entry.name, row) for entry in ledger_entries() for row in entry.upstream]


def declared_subclasses() -> dict[str, patches.Subclass]:
    return {
        declared.ours: declared
        for ledger in patches.installed_ledgers()
        for declared in patches.subclasses(ledger)
    }


# ---------------------------------------------------------------------- conventions (by example)

# The input batch's host/device pairs that _share_host_buffers aliases in emulation: sampling
# parameters whose device tensor is `name` and host tensor `name_cpu_tensor`.
INPUT_BATCH_PAIRS = (
    "temperature",
    "top_p",
    "top_k",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
)


def cpu_gpu_buffer_problems() -> list[str]:
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    buffer = CpuGpuBuffer(4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
    return [
        f"CpuGpuBuffer has no tensor .{side}: HPUModelRunner._share_host_buffers aliases it"
        for side in ("cpu", "gpu")
        if not isinstance(getattr(buffer, side, None), torch.Tensor)
    ]


def input_batch_problems() -> list[str]:
    import torch
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_input_batch import InputBatch

    batch = InputBatch(
        max_num_reqs=2,
        max_model_len=32,
        max_num_batched_tokens=32,
        device=torch.device("cpu"),
        vocab_size=64,
        block_sizes=[16],
        max_num_blocks_per_req=[2],
    )
    problems = [
        f"InputBatch.{name} / {name}_cpu_tensor is no longer a device/host tensor pair: "
        "HPUModelRunner._share_host_buffers would copy instead of alias it"
        for name in INPUT_BATCH_PAIRS
        if not (
            isinstance(getattr(batch, name, None), torch.Tensor)
            and isinstance(getattr(batch, f"{name}_cpu_tensor", None), torch.Tensor)
        )
    ]
    for table in batch.block_table.block_tables:
        buffers = {n for n, v in vars(table).items() if isinstance(v, CpuGpuBuffer)}
        if not {"block_table", "slot_mapping"} <= buffers:
            problems.append(
                f"BlockTable's CpuGpuBuffers are {sorted(buffers)}, not block_table and "
                "slot_mapping: HPUModelRunner._share_host_buffers aliases them"
            )
    return problems


CONVENTIONS: dict[str, Callable[[], list[str]]] = {
    "CpuGpuBuffer .cpu/.gpu": cpu_gpu_buffer_problems,
    "InputBatch X/X_cpu_tensor pairs and block-table buffers": input_batch_problems,
}


# ------------------------------------------------------------------------------------- the tests


SPEC_DECODE_KERNEL_NAMES = (
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel",
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel",
    "vllm.v1.sample.rejection_sampler.expand_kernel",
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel",
    "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel",
    "vllm.v1.spec_decode.utils.eagle_prepare_inputs_padded_kernel",
    "vllm.v1.spec_decode.utils.eagle_prepare_next_token_padded_kernel",
)


@pytest.mark.parametrize(
    "entry, expected",
    [(name, row) for name, row in ledger_rows() if row.applies()],
    ids=lambda v: str(v).rpartition(".")[2] if isinstance(v, str) else str(v),
)
def test_upstream_name_still_exists_with_the_parameters_we_rely_on(entry, expected):
    problems = problems_with(expected)

    assert problems == [], f"{entry}:\n" + "\n".join(problems)


def test_every_ledger_entry_was_read_against_the_installed_vllm():
    from vllm_gaudi_platform import compat

    found = compat.check_vllm().found
    stale = [e.name for e in ledger_entries() if found and str(found) not in e.checked_against]
    assert stale == [], (
        f"vLLM {found} is installed: read each entry's upstream code again and add it to "
        f"`checked_against` (or to patches.CHECKED): {stale}"
    )


def test_the_walk_finds_our_vllm_subclasses(emulated):
    found = drift.vllm_subclasses()

    assert "vllm_gaudi_platform.worker.model_runner:HPUModelRunner" in found
    assert "vllm_gaudi_ops.families.norm:HpuRMSNorm" in found
    assert len(found) >= 60


@pytest.mark.parametrize("name", sorted(drift.vllm_subclasses()), ids=str)
def test_every_method_of_our_subclass_overrides_one_of_vllm(emulated, name):
    problems = drift.override_problems(resolve(name), declared_subclasses().get(name))

    assert problems == [], "\n".join(problems)


def test_every_declared_subclass_exists_and_is_a_vllm_subclass(emulated):
    walked = drift.vllm_subclasses()

    assert sorted(set(declared_subclasses()) - set(walked)) == []


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_host_buffer_sharing_convention_holds(name):
    problems = CONVENTIONS[name]()

    assert problems == [], "\n".join(problems)


def test_slot_mapping_stand_in_takes_the_kernels_parameters_in_order():
    from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

    kernel = resolve("vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel")
    # Launched positionally (the names differ only by the kernel's `_ptr` suffixes), then the
    # compile-time constants by name.
    expected = [n.removesuffix("_ptr") for n in parameter_names(kernel)]

    assert parameter_names(triton_kernels.compute_slot_mapping) == expected


@pytest.mark.parametrize("name", sorted(SPEC_DECODE_KERNEL_NAMES))
def test_spec_decode_stand_in_takes_the_kernels_parameters_by_name(name):
    from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

    module, kernel = name.rsplit(".", 1)
    # vLLM's launcher forwards by keyword only when the names match exactly, in order.
    expected = parameter_names(resolve(f"{module}:{kernel}"))

    stand_ins = {**triton_kernels.SPEC_DECODE_KERNELS, **triton_kernels.EAGLE_KERNELS}

    assert parameter_names(stand_ins[name]) == expected


def test_mamba_memcpy_stand_in_takes_the_kernels_parameters_by_name():
    from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies

    expected = parameter_names(resolve("vllm.v1.worker.mamba_utils:batch_memcpy_kernel"))
    [stand_in] = mamba_state_copies.KERNELS.values()

    assert parameter_names(stand_in) == expected


def test_guard_reports_a_method_renamed_away_upstream(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    [expected] = [u for _, u in ledger_rows() if u.target == f"{RUNNER}._sync_device"]
    monkeypatch.delattr(GPUModelRunner, "_sync_device")

    [problem] = problems_with(expected)
    assert "GPUModelRunner._sync_device is gone" in problem


def test_guard_reports_a_renamed_parameter(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    [expected] = [
        u for _, u in ledger_rows() if u.target.endswith("_maybe_get_memory_pool_context")
    ]

    def renamed(self, pool_tag: str) -> Any:
        return None

    monkeypatch.setattr(Worker, "_maybe_get_memory_pool_context", renamed)

    [problem] = problems_with(expected)
    assert "['pool_tag']" in problem and "['tag']" in problem


def test_guard_reports_an_override_left_behind_by_an_upstream_rename(emulated, monkeypatch):
    from vllm.platforms.interface import Platform

    name = "vllm_gaudi_platform.platform:HpuPlatform"
    monkeypatch.delattr(Platform, "register_triton_kernel_overrides")

    problems = drift.override_problems(resolve(name), declared_subclasses()[name])

    assert any(
        "HpuPlatform.register_triton_kernel_overrides overrides nothing" in p for p in problems
    )


def test_guard_reports_a_broken_convention(monkeypatch):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.__init__

    def without_top_k_pair(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        del self.top_k_cpu_tensor

    monkeypatch.setattr(InputBatch, "__init__", without_top_k_pair)

    [problem] = input_batch_problems()
    assert "InputBatch.top_k" in problem
