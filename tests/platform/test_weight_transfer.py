"""The HPU weight-transfer engine's wire (weight_wire.py) over a real gloo group between two
threads, its registration with vLLM's factory, and what it refuses. The engine end to end (a
trainer process, HPU graphs, torch.compile, a dying trainer) is test_weight_update.py."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from vllm_gaudi_platform.distributed import weight_transfer, weight_wire


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(timeout_s: float = 20.0) -> tuple[weight_wire.WireGroup, weight_wire.WireGroup]:
    """Rank 0 (the trainer) and rank 1 (a worker), built concurrently as they rendezvous."""
    port = _port()
    groups: dict[int, weight_wire.WireGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = weight_wire.WireGroup("127.0.0.1", port, rank, 2, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return groups[0], groups[1]


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(33, 8, generator=gen)),
        ("model.norm.weight", torch.randn(7, generator=gen).to(torch.bfloat16)),  # odd bytes
        ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 3, generator=gen).half()),
        ("step", torch.tensor(3, dtype=torch.int64)),  # 0-d
    ]


@pytest.mark.parametrize("bucket_bytes", [0, 256, 1 << 20])
def test_plan_packs_consecutive_tensors_and_unpack_gives_them_back(bucket_bytes):
    tensors = _tensors()
    specs = [
        weight_wire.ParamSpec(n, weight_wire.dtype_name(t.dtype), tuple(t.shape))
        for n, t in tensors
    ]
    plan = weight_wire.plan_round(specs, bucket_bytes)
    plan.check()
    if bucket_bytes == 0:
        assert [(a, b) for a, b, _ in plan.buckets] == [(i, i + 1) for i in range(len(specs))]
    elif bucket_bytes >= 1 << 20:
        assert len(plan.buckets) == 1
    else:
        assert 1 < len(plan.buckets) < len(specs) + 1
    assert weight_wire.RoundPlan.from_json(plan.to_json()) == plan
    for first, end, nbytes in plan.buckets:
        buffer = weight_wire.pack([t for _, t in tensors[first:end]])
        assert buffer.numel() == nbytes
        for (_, want), got in zip(tensors[first:end], weight_wire.unpack(buffer, specs[first:end])):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_round_crosses_a_gloo_group_whole():
    trainer, worker = _pair()
    tensors = _tensors()
    received: dict = {}
    t = threading.Thread(target=lambda: received.update(r=weight_wire.receive_round(worker)))
    t.start()
    weight_wire.send_round(trainer, tensors, round_no=7, bucket_bytes=300)
    t.join(timeout=60)
    round_no, got = received["r"]
    assert round_no == 7
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert have.dtype == want.dtype and torch.equal(have, want)
    trainer.close()
    worker.close()


def test_a_trainer_that_leaves_mid_round_fails_the_worker_without_a_hang():
    trainer, worker = _pair(timeout_s=30.0)
    outcome: dict = {}

    def receive() -> None:
        start = time.perf_counter()
        try:
            weight_wire.receive_round(worker)
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.perf_counter() - start

    t = threading.Thread(target=receive)
    t.start()
    weight_wire.send_round(trainer, _tensors(), round_no=0, bucket_bytes=0, stop_after_buckets=1)
    trainer.close()  # the trainer's sockets close, as when its process dies
    t.join(timeout=60)
    assert not t.is_alive(), "the worker still waits for a trainer that left"
    assert outcome["error"] is not None
    assert outcome["seconds"] < 30.0


def test_a_worker_refuses_a_peer_that_does_not_speak_the_protocol():
    trainer, worker = _pair()
    outcome: dict = {}

    def receive() -> None:
        try:
            weight_wire.receive_round(worker)
        except ValueError as exc:
            outcome["error"] = str(exc)

    t = threading.Thread(target=receive)
    t.start()
    trainer.broadcast(torch.tensor([1, 2, 3, 4], dtype=torch.int64))
    t.join(timeout=60)
    assert "does not speak this engine's protocol" in outcome["error"]


def test_unsupported_dtype_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="cast the tensor before sending"):
        weight_wire.dtype_name(torch.complex64)


def test_group_size_must_count_the_trainer_and_the_workers():
    with pytest.raises(ValueError, match="world_size=1"):
        weight_wire.WireGroup("127.0.0.1", _port(), 0, 1, 5.0)


def test_registration_is_idempotent_and_reaches_vllms_factory():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    weight_transfer.register()
    weight_transfer.register()  # a second call (another plugin order, a forked process) is inert
    assert weight_transfer.registered()
    engine_cls = WeightTransferEngineFactory._registry["hpu"]()
    assert engine_cls is weight_transfer.HpuWeightTransferEngine
    # vLLM's own backends are still there.
    assert {"nccl", "ipc"} <= set(WeightTransferEngineFactory._registry)


@pytest.mark.parametrize(
    ("method", "why"),
    [
        ("awq_hpu", "activation-aware calibration"),
        ("gptq_hpu", "error compensation"),
        ("inc", "measured activation statistics"),
        ("compressed-tensors", "none of them re-quantizes"),
        ("gpt_oss_mxfp4", "E8M0 block scales"),
        ("bitsandbytes", "does not re-quantize on the way in"),
    ],
)
def test_quantized_models_other_than_fp8_are_refused_naming_the_method_why_and_the_fix(method, why):
    config = SimpleNamespace(model_config=SimpleNamespace(quantization=method))
    problem = weight_transfer.refusal(config)  # type: ignore[arg-type]
    assert problem is not None
    assert f"quantization={method!r}" in problem and "weight_transfer_config" in problem
    assert why in problem
    assert "Serve the model unquantized" in problem and "fp8 checkpoint" in problem
    with pytest.raises(ValueError, match="Serve the model unquantized"):
        weight_transfer.HpuWeightTransferEngine(None, config, torch.device("cpu"), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_unquantized_and_fp8_models_are_accepted(quantization):
    config = SimpleNamespace(model_config=SimpleNamespace(quantization=quantization))
    assert weight_transfer.refusal(config) is None  # type: ignore[arg-type]


class _Fp8LikeMethod:  # offers the re-quantizing calls
    def hpu_stage_weight_update(self, layer):
        staged = torch.nn.Parameter(layer.weight.data.float() * 2, requires_grad=False)
        staged.weight_loader = lambda p, w: p.data.copy_(w)  # type: ignore[attr-defined]
        return staged

    def hpu_commit_weight_update(self, layer, staged):
        layer.weight.data.copy_(staged.data.half())


class _PackedMethod:  # offers nothing: e.g. a 4-bit MoE method
    pass


def _layer(method) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.half), requires_grad=False)
    layer.quant_method = method
    return layer


def test_an_fp8_model_with_a_layer_that_does_not_requantize_is_refused_naming_it():
    from vllm_gaudi_platform.distributed import weight_quantized

    model = torch.nn.Sequential(_layer(_Fp8LikeMethod()), _layer(_PackedMethod()))
    problem = weight_quantized.model_refusal(model, "fp8")
    assert problem is not None
    assert "'1'" in problem and "_PackedMethod" in problem and "quantization='fp8'" in problem
    assert weight_quantized.model_refusal(model[:1], "fp8") is None


def test_staged_weights_commit_only_the_layers_the_round_wrote_into_their_storage():
    from vllm_gaudi_platform.distributed import weight_quantized

    model = torch.nn.Sequential(_layer(_Fp8LikeMethod()), _layer(_Fp8LikeMethod()))
    storages = [layer.weight.data_ptr() for layer in model]
    with weight_quantized.staged_weights(model) as loaded:
        staged = model[0].weight
        assert staged.dtype == torch.float32  # the checkpoint layout, not the quantized one
        staged.weight_loader(staged, torch.full((2, 3), 5.0))
        loaded.append({"0.weight"})  # what the model's load_weights returns
    assert [layer.weight.data_ptr() for layer in model] == storages
    assert model[0].weight.dtype == torch.half and torch.equal(
        model[0].weight, torch.full((2, 3), 5.0, dtype=torch.half)
    )
    assert torch.equal(model[1].weight, torch.ones(2, 3, dtype=torch.half))  # not written


def test_a_worker_without_the_setting_holds_no_engine():
    config = SimpleNamespace(weight_transfer_config=None)
    assert weight_transfer.engine_for_worker(config, torch.device("cpu"), None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", weight_transfer.CUDA_BACKENDS)
def test_vllms_cuda_backends_are_refused_on_the_hpu_naming_ours(backend):
    config = SimpleNamespace(weight_transfer_config=SimpleNamespace(backend=backend))
    with pytest.raises(ValueError, match=r'weight_transfer_config=\{"backend": "hpu"\}'):
        weight_transfer.engine_for_worker(config, torch.device("cpu"), None)  # type: ignore[arg-type]


class _DeadGroup:
    """A transfer group whose trainer has gone: every broadcast fails."""

    def broadcast(self, tensor):
        raise RuntimeError("Connection closed by peer")

    def close(self):
        pass


@pytest.mark.parametrize(("rank", "raises"), [(0, False), (1, True)])
def test_a_failed_round_is_raised_by_the_last_worker_only_and_written_by_none(
    monkeypatch, rank, raises
):
    engine = weight_transfer.HpuWeightTransferEngine.__new__(
        weight_transfer.HpuWeightTransferEngine
    )
    engine.group = _DeadGroup()  # type: ignore[assignment]
    engine.rounds_applied, engine.last_round, engine.last_error = 1, 0, None
    written: list = []
    monkeypatch.setattr(engine, "_apply", written.append)
    vote = SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=None)
    monkeypatch.setattr(engine, "_vote_group", lambda: vote)
    monkeypatch.setattr(engine, "_all_workers_agree", lambda ok: ok)
    info = weight_transfer.HpuWeightTransferUpdateInfo()
    if raises:
        with pytest.raises(RuntimeError, match="no parameter was written on any worker"):
            engine.receive_weights(info)
    else:
        engine.receive_weights(info)  # vLLM's executor hears the failure from the last rank
    assert written == [] and engine.group is None
    assert "serves the weights of update round 0" in (engine.last_error or "")


def test_an_update_is_refused_while_the_worker_sleeps():
    engine = weight_transfer.HpuWeightTransferEngine.__new__(
        weight_transfer.HpuWeightTransferEngine
    )
    engine.group = _DeadGroup()  # type: ignore[assignment]
    engine.last_error = None
    engine.asleep = lambda: True
    with pytest.raises(RuntimeError, match=r"asleep \(sleep mode\); call wake_up\(\)"):
        engine.start_weight_update()
    engine.asleep = lambda: False
    engine.start_weight_update()  # awake and connected: the session may start
