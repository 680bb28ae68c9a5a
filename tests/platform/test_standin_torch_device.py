"""The Habana stand-in's torch device "hpu" (registered on request: the stand-in engines and
neural-compressor's HPU flow) and its `.scalar` FP8 overloads: they follow the rules of a real
device and of the bridge's tensor-scale forms, so the tests over the stand-in cannot pass on
leniency.

The device is once per process and cannot be undone, so its checks run in a fresh process.
"""

from __future__ import annotations

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, standin_process_env
from tests.integration.generation import job_result

DEVICE_JOB = r"""
import json, os
os.environ["HABANA_STANDIN_TORCH_DEVICE"] = "1"
import torch
import habana_frameworks.torch  # noqa: F401
from habana_frameworks.torch import _torch_device

out = {}
x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to("hpu")
y = x * 2 + 1
out["devices"] = [x.device.type, y.device.type, torch.zeros(2, device="hpu").device.type,
                  torch.tensor([1.0], device="hpu").device.type, y.cpu().device.type]
out["plain_tensors"] = [type(x) is torch.Tensor, x.device == torch.device("hpu", 0)]
out["values"] = torch.equal(y.cpu(), torch.arange(12.0).reshape(3, 4) * 2 + 1)
reads = _torch_device.host_reads()
out["read_back"] = [x.sum().item(), x[0].tolist()]
out["host_reads"] = _torch_device.host_reads() - reads
returned = x.add_(1)
out["in_place_keeps_tensor"] = returned is x and x.device.type == "hpu" and x[0, 0].item() == 1.0
view = x[1:, ::2]
view.fill_(-1.0)
out["views_share_storage"] = [view.device.type, x.data_ptr() != 0, x[1].tolist()]
linear = torch.nn.Linear(4, 2).to("hpu")
out["module"] = [linear.weight.device.type, type(linear.weight).__name__, linear(x).device.type]
out["cpu_scalar_operand"] = (x * torch.tensor(2.0)).device.type
for name, op in (("mixed", lambda: x + torch.ones(3, 4)),
                 ("host_index", lambda: x[torch.tensor([0, 2])])):
    try:
        op()
        out[name] = "accepted"
    except RuntimeError as exc:
        out[name] = str(exc).splitlines()[0]
with torch.device("hpu"):
    out["default_device"] = [torch.arange(3).device.type, torch.empty(2, 2).device.type]
compiled = torch.compile(lambda a: (a * 2).sum(dim=0), backend="aot_eager")
out["compiled"] = [compiled(x).device.type, compiled(x).tolist() == (x * 2).sum(dim=0).tolist()]
out["torch_hpu"] = [torch.hpu.is_available(), torch.hpu.current_device(), torch.hpu.device_count()]
import habana_frameworks.torch.utils.experimental as htexp
out["device_type"] = htexp._get_device_type().name
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def device(run_python) -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("checks the Habana stand-in, which does not load beside a real Gaudi stack")
    env = standin_process_env(2)
    return job_result(run_python(DEVICE_JOB, env=env, timeout=900), "stand-in device job")


@pytest.mark.process
def test_tensors_moved_or_created_on_hpu_stay_there_until_read_back(device):
    assert device["devices"] == ["hpu", "hpu", "hpu", "hpu", "cpu"]
    assert device["plain_tensors"] == [True, True]
    assert device["values"] is True
    assert device["read_back"] == [66.0, [0.0, 1.0, 2.0, 3.0]]
    assert device["host_reads"] == 2  # .item() and .tolist()
    assert device["in_place_keeps_tensor"] is True
    assert device["default_device"] == ["hpu", "hpu"]


@pytest.mark.process
def test_device_tensors_are_plain_tensors_with_storage_views_and_parameters(device):
    # Views write through to their base; a module's parameters stay torch's Parameter type (vLLM's
    # parameter subclasses are built on it); torch.compile traces over device tensors.
    assert device["views_share_storage"] == ["hpu", True, [-1.0, 6.0, -1.0, 8.0]]
    assert device["module"] == ["hpu", "Parameter", "hpu"]
    assert device["compiled"] == ["hpu", True]


@pytest.mark.process
def test_an_op_mixing_hpu_and_cpu_tensors_is_refused_except_cpu_scalars(device):
    assert device["cpu_scalar_operand"] == "hpu"
    # torch's own device check refuses an elementwise op; the stand-in's backend refuses the rest
    # (here an index built on the host), naming the host operand.
    assert "found at least two devices, hpu:0 and cpu" in device["mixed"], device["mixed"]
    assert "tensors on hpu and cpu in one op (a cpu tensor of shape [2])" in device["host_index"]


@pytest.mark.process
def test_torch_hpu_and_the_device_type_answer_for_the_stand_ins_generation(device):
    assert device["torch_hpu"] == [True, 0, 1]
    assert device["device_type"] == "synDeviceGaudi2"


@pytest.mark.gaudi
def test_scalar_overloads_compute_what_the_tensor_scale_forms_compute(standin_device):
    import habana_frameworks.torch  # noqa: F401
    import torch

    hpu = torch.ops.hpu
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 1000
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    fp8 = torch.float8_e4m3fn
    q_scalar, _ = hpu.cast_to_fp8_v2.scalar(x, 0.5, False, False, fp8)
    q_tensor, _ = hpu.cast_to_fp8_v2(x, torch.tensor(0.5), False, False, fp8)
    assert torch.equal(q_scalar.float(), q_tensor.float())
    assert q_scalar.float().abs().max() == 448.0  # x * 0.5 saturates at Gaudi 3's range
    back = hpu.cast_from_fp8.scalar(q_scalar, 2.0, torch.float32)
    assert torch.equal(back, hpu.cast_from_fp8(q_scalar, torch.tensor(2.0), torch.float32))
    w8, _ = hpu.cast_to_fp8_v2(w, None, False, False, fp8)
    gemm = hpu.fp8_gemm_v2.scalar(q_scalar, False, w8, True, None, torch.float32, 2.0, 0.25)
    expect = hpu.fp8_gemm_v2(
        q_scalar, False, w8, True, None, torch.float32, torch.tensor(2.0), torch.tensor(0.25)
    )
    assert torch.equal(gemm, expect)
    assert torch.allclose(gemm, (q_scalar.float() @ w8.float().t()) * 0.5)
