"""The contract every vllm-gaudi general plugin follows, in one place.

vLLM runs `vllm.general_plugins` entry points once per process, in every process, in no defined
order across wheels, and sometimes more than once. `general_plugin` wraps a wheel's register
function so that it:

- runs its body at most once per process (idempotent);
- does nothing but one DEBUG line when the active platform is not HPU (real or emulated);
- turns a vLLM outside the supported range into one WARNING naming the version and the range,
  and registers nothing unless VLLM_HPU_SKIP_VERSION_CHECK=1 (compat.py: the one policy, which
  the platform's own entry point follows too);
- turns a missing optional dependency (ImportError) into one WARNING naming the package.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable

from vllm_gaudi_platform import compat

_logger = logging.getLogger("vllm.vllm_gaudi_platform.plugins")

# name -> outcome ("registered", "skipped: ...") for this process; read by tests and doctor.
OUTCOMES: dict[str, str] = {}


# vllm-gaudi-quant's entry points -> the quantization method names each registers with vLLM (what
# ModelConfig resolves a checkpoint to and passes to Platform.verify_quantization).
QUANT_METHODS: dict[str, tuple[str, ...]] = {
    "hpu_quant_inc": ("inc",),
    "hpu_quant_fp8": ("fp8",),
    "hpu_quant_awq": ("awq_hpu",),
    "hpu_quant_gptq": ("gptq_hpu",),
    "hpu_quant_compressed_tensors": ("compressed-tensors",),
    "hpu_quant_mxfp4": ("gpt_oss_mxfp4",),
}


def registered_quantization() -> list[str]:
    """The quantization methods whose entry point registered in this process, in table order."""
    return [
        method
        for entry_point, methods in QUANT_METHODS.items()
        if OUTCOMES.get(entry_point) == "registered"
        for method in methods
    ]


class MissingDependency(ImportError):
    """Raised by a register body when an optional package it needs is not installed."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed; install it with 'pip install {extra}' to enable this "
            "plugin"
        )
        self.package = package


def hpu_platform_active() -> bool:
    """True when vLLM's resolved platform is the HPU platform (Gaudi or emulated)."""
    from vllm.platforms import current_platform

    from vllm_gaudi_platform import PLATFORM_CLASS

    cls = type(current_platform)
    return f"{cls.__module__}.{cls.__qualname__}" == PLATFORM_CLASS


def require(package: str, import_name: str, extra: str) -> None:
    """Raise MissingDependency unless `import_name` can be imported."""
    if importlib.util.find_spec(import_name) is None:
        raise MissingDependency(package, extra)


def general_plugin(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Decorate a `vllm.general_plugins` register function `name` with the contract above."""

    def wrap(body: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(body)
        def register() -> None:
            if name in OUTCOMES:
                return
            # The platform first: off HPU a plugin is inert, with one DEBUG line and no other
            # word (not even about the vLLM version, which is not ours to judge there).
            if not hpu_platform_active():
                OUTCOMES[name] = "skipped: active platform is not HPU"
                _logger.debug("%s: active vLLM platform is not HPU; nothing registered", name)
                return
            problem, proceed = compat.version_refusal()
            if not proceed:
                OUTCOMES[name] = f"skipped: {problem}"
                _logger.warning("%s not registered: %s", name, problem)
                return
            if problem is not None:
                _logger.warning("%s: %s", name, problem)
            try:
                body()
            except MissingDependency as exc:
                OUTCOMES[name] = f"skipped: {exc}"
                _logger.warning("%s not registered: %s", name, exc)
                return
            OUTCOMES[name] = "registered"
            _logger.debug("%s registered", name)

        return register

    return wrap


def register_custom_op(op_cls: type, name: str) -> None:
    """Register `op_cls` as the out-of-tree replacement of vLLM's CustomOp class `name`.

    vLLM asserts on a duplicate name, so an existing registration of this same class is accepted
    (idempotence across reloads) and one by another class is reported, never overwritten.
    """
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    existing = op_registry_oot.get(name)
    if existing is op_cls:
        return
    if existing is not None:
        _logger.warning(
            "CustomOp %s already replaced by %s.%s; keeping it, not registering %s",
            name,
            existing.__module__,
            existing.__qualname__,
            op_cls.__qualname__,
        )
        return
    CustomOp.register_oot(_decorated_op_cls=op_cls, name=name)
