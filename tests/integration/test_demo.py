"""The README's main job: `vllm-gaudi demo`, as a newcomer runs it (no Gaudi, no setting).

It must turn emulation on by itself, generate, print the held-out perplexity through the HPU
platform next to transformers', report no recompile after warmup, and show none of the known
third-party start-up noise (third_party_noise.py) nor vLLM's warning about an unknown variable.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from vllm_gaudi_platform.commands import third_party_noise

pytestmark = pytest.mark.engine

NOISE = (
    "Failed to load",  # torchao's CUDA extensions
    "is an Enum subclass",  # torch's pytree deprecation, about torchao's types
    "doesn't include CPU backend",  # vLLM's Triton check
    "torch.distributed.reduce_op",  # FutureWarning from vLLM's Triton dispatcher
    "Unknown vLLM environment variable",  # vLLM's check, about our VLLM_HPU_EMULATION
    "exited unexpectedly",  # an engine process not shut down before the demo exits
)


@pytest.fixture(scope="module")
def demo(console_script, clean_env) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script("vllm-gaudi"), "demo", "--max-tokens", "8"],
        # As a newcomer runs it: PT_HPU_LAZY_MODE unset, the Gaudi default (eager mode, steps
        # through torch.compile), not the suite's lazy mode.
        env=clean_env({"PT_HPU_LAZY_MODE": None}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_the_demo_runs_in_emulation_and_exits_zero(demo):
    assert demo.returncode == 0, demo.stderr[-6000:]
    assert "running the HPU platform in CPU emulation" in demo.stdout
    assert "Device: HPU (emulated on cpu)" in demo.stdout
    assert "Recompiles after warmup: 0" in demo.stdout
    compiled = re.search(
        r"torch.compile: (\d+) graphs in warmup, (\d+) after, (\d+) graph breaks", demo.stdout
    )
    assert compiled, demo.stdout
    assert int(compiled.group(1)) > 0 and compiled.group(2, 3) == ("0", "0")


def test_the_demo_perplexity_through_the_hpu_platform_equals_transformers(demo):
    found = re.search(r"ratio (\d+\.\d+)", demo.stdout)
    assert found, demo.stdout
    assert float(found.group(1)) == pytest.approx(1.0, abs=1e-3)


def test_the_demo_shows_no_known_third_party_noise(demo):
    screen = demo.stdout + demo.stderr
    assert [n for n in NOISE if n in screen] == []
    # Our own platform still says what it is.
    assert "HPU platform active: Gaudi kernels emulated on cpu" in screen


def test_every_entry_point_registers_on_this_vllm(demo):
    # On both CI legs (vLLM 0.32's CPU build, 0.33 built as a Gaudi image builds it) no plugin
    # refuses: a refusal logs "<entry point> not registered: <why>".
    screen = demo.stdout + demo.stderr
    assert [line for line in screen.splitlines() if "not registered" in line] == []


def test_the_noise_filters_drop_only_their_own_messages():
    import logging

    third_party_noise.silence()
    third_party_noise.silence()  # idempotent: one filter per logger
    torchao = logging.getLogger("torchao")
    assert len(torchao.filters) == 1
    record = logging.LogRecord("torchao", logging.WARNING, "", 0, "%s", ("x",), None)
    failed = "Failed to load /venv/lib/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: nope"
    record.msg, record.args = failed, ()
    assert torchao.filters[0].filter(record) is False
    record.msg = "Some other torchao warning"
    assert torchao.filters[0].filter(record) is True
