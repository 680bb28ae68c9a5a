"""What the HPU platform tells vLLM's Ray executor, and how it prepares a Ray start: the "HPU"
resource Ray knows Gaudis by, a clear error instead of a placement group that never comes, and the
plugins' variables in every Ray worker from its first import."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from ray._private.accelerators.hpu import HPUAcceleratorManager

from vllm_gaudi_platform.distributed import ray_cluster


@pytest.fixture
def platform(emulated):
    from vllm_gaudi_platform.platform import HpuPlatform

    return HpuPlatform


@pytest.fixture
def parallel_config():
    return SimpleNamespace(world_size=2, ray_runtime_env=None)


@pytest.fixture
def no_cluster(monkeypatch):
    import ray

    # Empty rather than deleted: monkeypatch then restores it after prepare() sets it.
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_platform_asks_ray_for_the_resource_ray_names_gaudis_by(platform):
    assert platform.ray_device_key == HPUAcceleratorManager.get_resource_name() == "HPU"
    assert ray_cluster.per_worker_request() == {"HPU": 1.0}


def test_ray_leaves_the_visible_modules_variable_to_vllm(platform):
    assert platform.device_control_env_var == (
        HPUAcceleratorManager.get_visible_accelerator_ids_env_var()
    )
    assert platform.ray_noset_device_env_vars == ["RAY_EXPERIMENTAL_NOSET_HABANA_VISIBLE_MODULES"]


def test_missing_ray_is_an_error_naming_the_platform_extra(monkeypatch, parallel_config):
    monkeypatch.setattr(ray_cluster, "is_installed", lambda: False)

    with pytest.raises(ValueError, match=r"vllm-gaudi-platform\[ray\]"):
        ray_cluster.prepare(parallel_config, emulated=True)


def test_emulation_without_a_cluster_is_an_error_saying_how_to_declare_hpus(
    no_cluster, parallel_config
):
    with pytest.raises(ValueError, match=r"""--resources='\{"HPU": 2\}'"""):
        ray_cluster.prepare(parallel_config, emulated=True)


def test_a_gaudi_node_needs_no_declared_resources(no_cluster, parallel_config):
    ray_cluster.prepare(parallel_config, emulated=False)

    assert parallel_config.ray_runtime_env is not None


def test_a_cluster_started_in_this_process_is_the_one_the_engine_joins(
    monkeypatch, no_cluster, parallel_config
):
    import ray

    context = SimpleNamespace(gcs_address="127.0.0.1:6379")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)

    ray_cluster.prepare(parallel_config, emulated=True)

    assert os.environ["RAY_ADDRESS"] == "127.0.0.1:6379"


def test_workers_start_with_the_plugin_variables_and_the_operator_s_win(
    monkeypatch, parallel_config
):
    from ray.runtime_env import RuntimeEnv

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    parallel_config.ray_runtime_env = RuntimeEnv(env_vars={"PT_HPU_LAZY_MODE": "1"}, pip=["x"])

    ray_cluster.prepare(parallel_config, emulated=True)

    runtime_env = parallel_config.ray_runtime_env
    assert runtime_env["env_vars"]["VLLM_HPU_EMULATION"] == "cpu"
    assert runtime_env["env_vars"]["PT_HPU_LAZY_MODE"] == "1"
    assert runtime_env["pip"]["packages"] == ["x"]
