"""`vllm serve` on vLLM's own CPU backend with all four wheels installed, no Gaudi, no emulation.

vLLM's API server loads every stat-logger plugin whatever the platform, so a machine that merely
has the wheels installed (a GPU box, a CPU runner, a shared image) must start, serve, and publish
none of the HPU metrics. The same metrics on the HPU platform are checked in test_serve.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.integration import openai_server
from tests.integration.generation import ENGINE, assert_close, hf_greedy, make_prompts
from tests.integration.openai_server import as_result, post
from tests.vllm_build import needs_vllm_cpu_backend

pytestmark = [pytest.mark.engine, needs_vllm_cpu_backend]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model() -> str:
    return str(tinymodels.build("llama"))


@pytest.fixture(scope="module")
def server(model, clean_env, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("serve-off-hpu") / "server.log"
    # No VLLM_* setting at all: vLLM picks its CPU platform, our plugins must stay out of the way.
    env = {k: v for k, v in clean_env().items() if not k.startswith("VLLM_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # Eager, as the other runs of vLLM's CPU backend here: its inductor compile is not what this
    # test checks and costs more than the two completions.
    args = [*openai_server.engine_args(model, ENGINE), "--enforce-eager"]
    with openai_server.running(args, env, log) as base:
        yield base, log


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    base, _ = server
    with httpx.Client(base_url=base, timeout=120, trust_env=False) as c:
        yield c


def test_the_server_answers_a_completion_on_vllms_cpu_backend(model, server, client):
    prompts = make_prompts()[:2]
    body = post(client, "/v1/completions", openai_server.completion_body(prompts, MAX_TOKENS))
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [len(c["token_ids"]) for c in choices] == [MAX_TOKENS] * len(prompts)
    reference = hf_greedy(model, prompts, max_tokens=MAX_TOKENS)
    assert_close([as_result(c) for c in choices], reference, "vLLM CPU backend vs transformers")
    _, log = server
    text = log.read_text(errors="replace")
    assert "HPU platform active" not in text
    assert "Platform plugin hpu is activated" not in text


def test_metrics_show_no_hpu_metric(client):
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "vllm:num_requests_running" in response.text  # vLLM's own metrics are there
    assert "vllm:hpu_" not in response.text


def test_our_plugins_log_nothing_above_debug(model, server, client):
    _, log = server
    # vLLM itself lists the entry points it found ("- hpu_metrics -> vllm_gaudi_platform...");
    # any other line above DEBUG that names HPU, Gaudi or our packages came from us.
    listing = re.compile(r"\] - hpu_\w+ -> vllm_gaudi_")
    ours = re.compile(r"hpu|gaudi|habana", re.IGNORECASE)
    lines = [
        line
        for line in log.read_text(errors="replace").replace(model, "<model>").splitlines()
        if re.search(r"\b(INFO|WARNING|ERROR)\b", line)
        and ours.search(line)
        and not listing.search(line)
    ]
    assert lines == []
    assert "Traceback" not in log.read_text(errors="replace")
