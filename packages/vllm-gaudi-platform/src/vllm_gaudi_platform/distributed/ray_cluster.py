"""What the HPU platform needs from a Ray cluster when vLLM runs its Ray executor
(`--distributed-executor-backend ray`): Ray installed (the platform wheel's `ray` extra), one Ray
"HPU" resource per worker, and the plugins' environment in every worker from its first import.

vLLM's executor asks Ray for `{"HPU": 1}` per worker (VLLM_RAY_PER_WORKER_GPUS, default 1) in a
placement group. On a Gaudi node Ray detects the modules itself (through habana_frameworks); a
CPU-only machine has none to detect, so in emulation the cluster must declare them
(`ray start --head --resources='{"HPU": 2}'`, or `ray.init(resources={"HPU": 2})` in the
process that builds the engine). Without them vLLM would wait half an hour for a placement group
that can never be created; this module refuses such a start at once instead.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from vllm_gaudi_platform import envs

if TYPE_CHECKING:
    from vllm.config import ParallelConfig

RAY_RESOURCE = "HPU"
RAY_ADDRESS = "RAY_ADDRESS"
RAY_EXTRA = "pip install 'vllm-gaudi-platform[ray]'"

# Set by the platform (platform._set_gaudi_runtime_env) for the Gaudi runtime, which reads them
# when it starts: a Ray worker must have them before it imports anything.
_RUNTIME_VARIABLES = ("PT_HPU_ENABLE_LAZY_COLLECTIVES",)


def is_installed() -> bool:
    """Whether Ray can be imported here (the platform wheel's optional `ray` extra)."""
    return importlib.util.find_spec("ray") is not None


def per_worker_request() -> dict[str, float]:
    """The Ray resources vLLM's executor requests for each worker on this platform."""
    return {RAY_RESOURCE: float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))}


def worker_env() -> dict[str, str]:
    """The plugins' variables set in this process, which every Ray worker needs at start-up."""
    names = [*envs.VARIABLES, *_RUNTIME_VARIABLES]
    return {name: os.environ[name] for name in names if name in os.environ}


def prepare(parallel_config: ParallelConfig, *, emulated: bool) -> None:
    """Make vLLM's Ray executor start on the HPU platform, or fail now with the fix.

    - Ray missing: an error naming the extra to install.
    - Ray already initialized in this process (`ray.init(resources={"HPU": 2})`): RAY_ADDRESS
      names that cluster, so the engine-core process, which calls `ray.init()` again, joins it
      instead of starting a cluster of its own without the declared resources.
    - Emulation with no cluster to join: an error saying how to declare HPU resources.
    - The plugins' variables go into the workers' runtime environment.
    """
    if not is_installed():
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            f"{RAY_EXTRA} (or pass distributed_executor_backend='mp' for one node)."
        )
    import ray

    if ray.is_initialized() and not os.environ.get(RAY_ADDRESS):
        os.environ[RAY_ADDRESS] = ray.get_runtime_context().gcs_address
    if emulated and not os.environ.get(RAY_ADDRESS):
        raise ValueError(
            "distributed_executor_backend='ray' in emulation: a CPU-only machine has no HPU for "
            f"Ray to detect, and vLLM asks Ray for one '{RAY_RESOURCE}' resource per worker. "
            "Declare them in a cluster and point RAY_ADDRESS at it: "
            f'`ray start --head --resources=\'{{"{RAY_RESOURCE}": '
            f"{parallel_config.world_size}}}'` then RAY_ADDRESS=auto, or call "
            f'`ray.init(resources={{"{RAY_RESOURCE}": {parallel_config.world_size}}})` in this '
            "process before building the engine."
        )
    _add_worker_env(parallel_config)


def _add_worker_env(parallel_config: ParallelConfig) -> None:
    # Ray workers run in processes started by the raylet, whose environment is the one `ray start`
    # (or ray.init) saw; vLLM copies the driver's variables only after the worker has imported
    # vLLM, too late for the seam's choice of backend and the Gaudi runtime settings.
    from ray.runtime_env import RuntimeEnv

    base: dict[str, Any] = dict(parallel_config.ray_runtime_env or {})
    env_vars = {**worker_env(), **dict(base.get("env_vars") or {})}  # the operator's win
    parallel_config.ray_runtime_env = RuntimeEnv(**{**base, "env_vars": env_vars})
