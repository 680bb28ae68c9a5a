"""Tensor parallelism over vLLM's Ray executor, against one worker, in one fresh process:

    python ray_job.py '<json job>'

First the engine_job.py job runs with one worker and no Ray. Then the process starts a local Ray
cluster sized for a small machine that declares as many "HPU" resources as there are workers (a
CPU-only machine has none for Ray to detect) and runs the same job with `tensor_parallel_size`
workers that vLLM's Ray executor places as Ray actors. Prints `RESULT tp1 <json>` and
`RESULT ray <json>` (engine_job.py's results; the Ray one adds the cluster's resources and the
executor class).

Job keys: those of engine_job.py, plus tensor_parallel_size and ray_cpus (the CPUs the cluster
declares). Run it with VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine then lives in this process,
which owns the Ray cluster.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.engine_job import run as run_engine_job


def run(job: dict) -> None:
    print("RESULT tp1 " + json.dumps(run_engine_job(job)), flush=True)
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()

    import ray

    tp = job["tensor_parallel_size"]
    ray.init(
        num_cpus=job.get("ray_cpus", 1),
        num_gpus=0,
        resources={"HPU": tp},
        include_dashboard=False,
        log_to_driver=False,
    )
    engine = {**job["engine"], "tensor_parallel_size": tp, "distributed_executor_backend": "ray"}
    result = run_engine_job({**job, "engine": engine})
    result["cluster_resources"] = ray.cluster_resources()
    print("RESULT ray " + json.dumps(result), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
    # Ray's and vLLM's exit handlers can wait minutes on actors that are already gone; the results
    # are printed, so leave without them (Ray's processes exit with their owner).
    os._exit(0)
