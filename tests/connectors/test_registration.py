"""The hpu_nixl entry point and HpuNixlConnector's settings checks."""

from __future__ import annotations

import socket

import pytest

from vllm_gaudi_connectors.nixl import (
    check_kv_buffer_device,
    check_side_channel_port,
    uses_host_staging,
)

REGISTER_TWICE = """
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.config import KVTransferConfig
from vllm_gaudi_connectors import register
from vllm_gaudi_platform import plugins
register.nixl()
plugins.OUTCOMES.clear()  # as if a second general-plugin pass ran in this process
register.nixl()
cls = KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="HpuNixlConnector", kv_role="kv_producer")
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
print(cls.__name__, issubclass(cls, NixlConnector), plugins.OUTCOMES["hpu_nixl"])
"""


@pytest.mark.process
def test_entry_point_registers_the_connector_once_even_when_run_twice(run_python):
    result = run_python(REGISTER_TWICE, {"VLLM_HPU_EMULATION": "cpu"})

    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "HpuNixlConnector True registered"


def test_connector_keeps_the_hpu_kv_layout():
    from vllm_gaudi_connectors.nixl import HpuNixlConnector

    class Model:
        use_mla = False

    class Config:
        model_config = Model()

    assert HpuNixlConnector.get_required_kvcache_layout(Config()) == "LBNHC"


def test_host_staging_and_device_to_device_are_accepted():
    check_kv_buffer_device("cpu", device_to_device=False)
    check_kv_buffer_device("hpu", device_to_device=True)


def test_the_hpu_kv_cache_is_staged_for_a_cpu_transfer_buffer_only():
    assert uses_host_staging("cpu")
    assert not uses_host_staging("hpu")


@pytest.mark.parametrize(
    ("device", "d2d", "names"),
    [
        ("hpu", False, "VLLM_NIXL_DEVICE_TO_DEVICE=true"),
        ("cpu", True, 'set "kv_buffer_device": "hpu"'),
        ("cuda", False, "not supported on HPU"),
    ],
)
def test_a_transfer_buffer_that_cannot_work_is_refused_naming_the_fix(device, d2d, names):
    with pytest.raises(ValueError, match="kv_buffer_device") as err:
        check_kv_buffer_device(device, device_to_device=d2d)
    assert names in str(err.value)


def test_a_taken_side_channel_port_is_refused_naming_the_variable():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"localhost:{port}") as err:
            check_side_channel_port("localhost", port)
    assert "set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port" in str(err.value)


def test_a_free_side_channel_port_is_accepted():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_side_channel_port("localhost", port)


PROGRESS_WAIT = """
import sys
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
from vllm_gaudi_connectors.nixl import progress_wait

binding = sys.modules[NixlWrapper.__module__].nixlBind
create = binding.nixlAgent
delays = []

def spy(name, config):
    delays.append(config.pthrDelay)
    return create(name, config)

binding.nixlAgent = spy
for wait_ms in (0, 3):
    with progress_wait(wait_ms):
        # As vLLM's worker creates its agent (UCX backend, progress thread, 4 worker threads).
        agent = NixlWrapper(f"agent-{wait_ms}", nixl_agent_config(num_threads=4))
    assert agent.get_agent_metadata()
print(delays, binding.nixlAgent is spy)
"""


@pytest.mark.process
def test_progress_wait_reaches_the_agents_progress_thread_and_zero_keeps_nixls(run_python):
    """NIXL's own agent sets no wait (0 microseconds); the setting's milliseconds reach the
    real binding as microseconds, and the binding is put back after the agent is created."""
    result = run_python(PROGRESS_WAIT, {"VLLM_HPU_EMULATION": "cpu"})

    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[0, 3000] True"


@pytest.mark.parametrize("value", ["-1", "1.5", "soon"])
def test_progress_wait_setting_refuses_what_is_not_whole_milliseconds(monkeypatch, value):
    from vllm_gaudi_platform import envs

    monkeypatch.setenv(envs.VLLM_HPU_NIXL_PROGRESS_WAIT_MS, value)
    with pytest.raises(envs.EnvError, match=r"VLLM_HPU_NIXL_PROGRESS_WAIT_MS.*whole number"):
        envs.nixl_progress_wait_ms()
    monkeypatch.setenv(envs.VLLM_HPU_NIXL_PROGRESS_WAIT_MS, "2")
    assert envs.nixl_progress_wait_ms() == 2
