"""`vllm-gaudi doctor`'s checks of the packages a wheel can use but does not require (Ray,
neural-compressor, NIXL with its UCX backend, vLLM's router) and of torchvision beside torch:
each adds to the report's `optional`, `info` and `problems` (commands/doctor.py builds and prints
the report)."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from importlib import metadata

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.commands.doctor_report import Report, Wheel

QUANT_WHEEL = "vllm-gaudi-quant"


@dataclass(frozen=True)
class OptionalDependency:
    """A package a wheel can use but does not require; missing means a feature is off."""

    package: str
    import_name: str
    distributions: tuple[str, ...]
    install: str
    enables: str


OPTIONAL_DEPENDENCIES: dict[str, tuple[OptionalDependency, ...]] = {
    "vllm-gaudi-platform": (
        OptionalDependency(
            "ray",
            "ray",
            ("ray",),
            "pip install 'vllm-gaudi-platform[ray]'",
            "vLLM's Ray executor (--distributed-executor-backend ray, multi-node)",
        ),
        OptionalDependency(
            "numba",
            "numba",
            ("numba",),
            "pip install numba",
            "vLLM's n-gram speculative decoding",
        ),
    ),
    "vllm-gaudi-quant": (
        OptionalDependency(
            "neural-compressor",
            "neural_compressor",
            ("neural-compressor-pt", "neural-compressor"),
            "pip install 'vllm-gaudi-quant[inc]'",
            "INC FP8 quantization",
        ),
    ),
    "vllm-gaudi-connectors": (
        OptionalDependency(
            "nixl",
            "nixl",
            ("nixl",),
            "pip install 'vllm-gaudi-connectors[nixl]'",
            "the NIXL KV connector (disaggregated prefill/decode)",
        ),
        OptionalDependency(
            "vllm-router",
            "vllm_router",
            ("vllm-router",),
            "pip install 'vllm-gaudi-connectors[router]' (or wherever the router runs)",
            "vLLM's router in front of prefill and decode instances, from this environment",
        ),
    ),
}


def check_optional(report: Report, wheels: list[Wheel]) -> None:
    for wheel in wheels:
        for dep in OPTIONAL_DEPENDENCIES.get(wheel.name, ()):
            found = importlib.util.find_spec(dep.import_name) is not None
            version = None
            for dist in dep.distributions:
                try:
                    version = metadata.version(dist)
                    break
                except metadata.PackageNotFoundError:
                    continue
            report.optional.append(
                {
                    "wheel": wheel.name,
                    "package": dep.package,
                    "import_name": dep.import_name,
                    "installed": found,
                    "version": version,
                }
            )
            if dep.import_name == "ray":
                _report_ray(report, version if found else None)
            elif found and dep.import_name == "nixl":
                _check_nixl_backend(report, version)
            elif found and wheel.name == QUANT_WHEEL:
                # Whether its method is available is the quantization check's to say: the
                # package alone registers nothing.
                report.info.append(f"{dep.package} {version or ''} found")
            elif found:
                report.info.append(f"{dep.package} {version or ''} found: {dep.enables} available")
            else:
                report.info.append(
                    f"{dep.package} (import {dep.import_name}) not installed: {dep.enables} is "
                    f"off; {dep.install}"
                )


def _report_ray(report: Report, version: str | None) -> None:
    """Whether vLLM's Ray executor can run, and which Ray resources each worker will ask for."""
    from vllm_gaudi_platform.distributed import ray_cluster

    request = ray_cluster.per_worker_request()
    if version is None:
        report.info.append(
            f"ray not installed: vLLM's Ray executor is off; {ray_cluster.RAY_EXTRA}"
        )
        return
    where = (
        "a CPU-only cluster must declare them, e.g. "
        f"ray start --head --resources='{{\"{ray_cluster.RAY_RESOURCE}\": 2}}'"
        if os.environ.get(envs.VLLM_HPU_EMULATION)
        else "Ray detects Gaudi modules through habana_frameworks"
    )
    report.info.append(
        f"ray {version} found: vLLM's Ray executor is available; each worker requests Ray "
        f"resources {request} ({where})"
    )


# Run in a child interpreter: loading NIXL's agent imports torch and native plugins, which doctor
# keeps out of its own process.
_NIXL_PROBE = """
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("vllm-gaudi-doctor", nixl_agent_config(backends=["UCX"]))
print("UCX" in agent.get_plugin_list() and "UCX" in agent.backends)
"""


def _check_nixl_backend(report: Report, version: str | None) -> None:
    """Whether nixl loads and instantiates its UCX backend (what HpuNixlConnector uses)."""
    ok, detail = _probe_nixl_ucx()
    if ok:
        report.info.append(
            f"nixl {version or ''} found, UCX backend loads: the NIXL KV connector is available"
        )
    else:
        report.problems.append(
            f"nixl {version or ''} is installed but its UCX backend does not load ({detail}); "
            "reinstall with pip install --force-reinstall 'vllm-gaudi-connectors[nixl]'"
        )


@functools.cache
def _probe_nixl_ucx() -> tuple[bool, str]:
    """(loads, last stderr line), probed once per process (a child interpreter takes seconds)."""
    import subprocess
    import sys

    try:
        probe = subprocess.run(
            [sys.executable, "-c", _NIXL_PROBE],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        lines = probe.stdout.strip().splitlines()
        ok = probe.returncode == 0 and bool(lines) and lines[-1] == "True"
        detail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, detail = False, repr(exc)
    return ok, detail


def check_torchvision(report: Report) -> None:
    """Vision-language models need torchvision's Python parts (their processors)."""
    try:
        found = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        report.info.append("torchvision not installed: vision-language models need it")
        return
    torch_found = report.versions.get("torch", {}).get("found") or ""
    if found.partition("+")[2] == torch_found.partition("+")[2]:
        return
    report.info.append(
        f"torchvision {found} is not the build of torch {torch_found or '?'}: if its compiled "
        "library does not load, `import torchvision` fails ('operator torchvision::nms does "
        "not exist') and vision-language models with it; install the torchvision built for "
        "this torch"
    )
