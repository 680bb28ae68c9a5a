"""The runner's torch.compile wrapper (worker/compiled.py) without an engine: graph breaks are
caught and named by layer, compiles after warmup count as recompiles, the counts reach the
serving metrics, and step metadata is made bucket-shaped for a compiled pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_gaudi_platform.observability import metrics
from vllm_gaudi_platform.worker import compiled


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class ReadsAValue(torch.nn.Module):
    """A layer that reads a tensor value on the host: dynamo cannot keep it in the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return x + 1
        return x - 1


class Stack(torch.nn.Module):
    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # The suite runs in lazy mode, where the platform turns dynamo off in-process once an
    # engine config was checked here; these tests are about eager mode's compiles.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


def test_a_model_that_traces_whole_compiles_one_graph_per_shape():
    model = compiled.CompiledModel(Stack(Scale(), Scale()), "eager", strict=True)

    for rows in (2, 2, 3, 3):
        model(x=torch.ones(rows, 4))

    assert model.stats.graphs == {"warmup": 2, "serving": 0}
    assert model.stats.breaks == {"warmup": [], "serving": []}


def test_a_graph_break_is_named_by_the_layer_that_caused_it():
    model = compiled.CompiledModel(Stack(Scale(), ReadsAValue()), "eager", strict=False)

    out = model(x=torch.ones(2, 4))

    assert torch.equal(out, torch.full((2, 4), 3.0))  # still the eager result
    (brk,) = model.stats.breaks["warmup"][:1]
    assert brk.module == "ReadsAValue.forward (layers.1)"
    assert brk.file == __file__ and "item" in brk.reason
    assert "ReadsAValue.forward (layers.1)" in brk.describe()


def test_a_graph_break_in_warmup_is_an_error_with_full_warmup():
    model = compiled.CompiledModel(Stack(ReadsAValue()), "eager", strict=True)

    with pytest.raises(compiled.GraphBreakError, match=r"ReadsAValue\.forward \(layers\.0\)"):
        model(x=torch.ones(2, 4))


def test_a_ledgered_break_is_counted_but_allowed(monkeypatch):
    monkeypatch.setitem(
        compiled.GRAPH_BREAK_LEDGER, ("test_compiled.py", "forward"), "a test's own break"
    )
    model = compiled.CompiledModel(Stack(ReadsAValue()), "eager", strict=True)

    model(x=torch.ones(2, 4))

    assert model.stats.breaks["warmup"] and all(b.ledgered() for b in model.stats.breaks["warmup"])


def test_a_compile_after_warmup_is_a_recompile_of_its_bucket_and_reaches_the_metrics():
    published: list[tuple[dict, dict]] = []
    step = metrics.StepMetrics()
    model = compiled.CompiledModel(
        Stack(Scale()),
        "eager",
        strict=True,
        publish=lambda g, b: (published.append((g, b)), step.set_compile(g, b)),
    )
    model.current_bucket = "prompt bs=1 q=128 ctx=0"
    model(x=torch.ones(2, 4))
    model.warmup_done()
    model(x=torch.ones(2, 4))  # a warmed shape: its guards hold
    assert model.stats.recompiles == 0

    model.current_bucket = "decode bs=8 ctx=4"
    model(x=torch.ones(8, 4))  # a shape warmup never ran

    assert model.stats.graphs == {"warmup": 1, "serving": 1}
    assert model.stats.recompiles == 1
    assert model.stats.recompiled_buckets == ["decode bs=8 ctx=4"]
    assert model.stats.by_bucket == {"prompt bs=1 q=128 ctx=0": 1, "decode bs=8 ctx=4": 1}
    assert published[-1] == ({"warmup": 1, "serving": 1}, {"warmup": 0, "serving": 0})
    snap = step.snapshot()
    assert (snap["compiled_graphs_warmup"], snap["compiled_graphs_serving"]) == (1, 1)
    assert as_dict_is_json_ready(model.stats.as_dict())


def as_dict_is_json_ready(stats: dict) -> bool:
    import json

    return json.loads(json.dumps(stats)) == stats


def test_step_metadata_becomes_bucket_shaped():
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata
    from vllm_gaudi_platform.attention.step_layout import plan_step
    from vllm_gaudi_platform.bucketing import plan_from_env

    plan = plan_from_env(
        max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, block_size=128
    )
    layout = plan_step(query_lens=[5, 1], seq_lens=[5, 40], block_size=128, plan=plan)
    md = build_metadata(
        layout=layout,
        seq_lens=[5, 40],
        block_table=torch.tensor([[1], [2]], dtype=torch.int32),
        slot_mapping=torch.tensor([128, 129, 130, 131, 132, 295]),
        block_size=128,
        device="cpu",
    )

    shaped = compiled.bucket_shaped(md)

    total = layout.num_tokens_padded
    assert shaped.num_actual_tokens == total and not shaped.identity_layout
    assert shaped.slot_mapping.tolist() == [128, 129, 130, 131, 132, 295] + [0] * (total - 6)
    assert shaped.cell_to_token is md.cell_to_token  # tensors are shared, not copied
    assert compiled.bucket_shaped(shaped) is shaped
    fields = {f.name for f in dataclasses.fields(md)}
    assert {"slot_mapping", "num_actual_tokens", "identity_layout"} <= fields
    assert "prompt bs=" in compiled.bucket_label({"layer": shaped})


COMPILE_SETTINGS = (
    "import os, torch._dynamo\n"
    "from vllm.engine.arg_utils import EngineArgs\n"
    "from gaudi_testkit import tinymodels\n"
    "model = str(tinymodels.build('llama'))\n"
    "cases = {\n"
    "    'default': {},\n"
    "    'trace-once': {'compilation_config': {'mode': 2}},\n"
    "    'eager': {'enforce_eager': True},\n"
    "}\n"
    "for name, kwargs in cases.items():\n"
    "    try:\n"
    "        config = EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()\n"
    "        print('CASE', name, 'mode', int(config.compilation_config.mode),\n"
    "              'dynamo-off', torch._dynamo.config.disable,\n"
    "              'exported', 'TORCHDYNAMO_DISABLE' in os.environ, flush=True)\n"
    "    except Exception as exc:\n"
    "        print('CASE', name, 'refused', str(exc).replace(chr(10), ' '), flush=True)\n"
)


def _cases(result) -> dict[str, str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        line.split()[1]: line.split(" ", 2)[2]
        for line in result.stdout.splitlines()
        if line.startswith("CASE ")
    }


@pytest.mark.process
def test_eager_mode_compiles_in_the_runner_and_refuses_what_it_would_not_honour(run_python):
    cases = _cases(
        run_python(COMPILE_SETTINGS, {"VLLM_HPU_EMULATION": "cpu", "PT_HPU_LAZY_MODE": "0"})
    )

    # vLLM's own compile integration is off: the runner compiles (worker/compiled.py).
    assert cases["default"] == "mode 0 dynamo-off False exported False"
    assert cases["eager"] == "mode 0 dynamo-off False exported False"
    assert cases["trace-once"].startswith("refused")
    assert "compilation mode DYNAMO_TRACE_ONCE is not supported on HPU" in cases["trace-once"]
    assert "leave the compilation mode unset" in cases["trace-once"]


@pytest.mark.process
def test_lazy_mode_turns_dynamo_off_in_the_process_without_exporting_it(run_python):
    cases = _cases(
        run_python(COMPILE_SETTINGS, {"VLLM_HPU_EMULATION": "cpu", "PT_HPU_LAZY_MODE": "1"})
    )

    # A child process started in eager mode must not inherit a disabled dynamo.
    assert cases["default"] == "mode 0 dynamo-off True exported False"


@pytest.mark.process
def test_torch_compile_with_dynamo_disabled_is_refused_by_name(run_python):
    env = {"VLLM_HPU_EMULATION": "cpu", "PT_HPU_LAZY_MODE": "0", "TORCHDYNAMO_DISABLE": "1"}
    cases = _cases(run_python(COMPILE_SETTINGS, env))

    assert cases["default"].startswith("refused")
    assert "PT_HPU_LAZY_MODE=0 runs steps through torch.compile" in cases["default"]
    assert "unset TORCHDYNAMO_DISABLE" in cases["default"]
    assert cases["eager"].startswith("mode 0")  # enforce_eager=True compiles nothing: accepted
