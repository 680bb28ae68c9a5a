"""Registering a family's Gaudi classes as the out-of-tree replacements of vLLM CustomOp classes."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from vllm_gaudi_platform.plugins import general_plugin, register_custom_op


def replace_ops(pairs: tuple[tuple[type, type], ...]) -> None:
    """Register each (in-tree class, Gaudi subclass) pair, keyed by the in-tree class name.

    vLLM instantiates the registered class whenever a model builds the in-tree class by name.
    `CustomOp.register_oot` also renames the replacement's `name` to the class name, but vLLM
    decides whether an op is enabled (`compilation_config.custom_ops`, e.g. "+rms_norm") by
    `name`; the replacement gets the in-tree op name back so that the same settings keep
    enabling and disabling it.
    """
    from vllm.model_executor.custom_op import op_registry_oot

    for in_tree, replacement in pairs:
        register_custom_op(replacement, in_tree.__name__)
        if op_registry_oot.get(in_tree.__name__) is replacement and hasattr(in_tree, "name"):
            replacement.name = in_tree.name


def family_plugin(entry_point: str, module: str) -> Callable[[], None]:
    """The `vllm.general_plugins` register function of the op family in `module`.

    Calling it imports `module` and passes its `REPLACEMENTS` to `replace_ops`, under the
    general-plugin contract of `vllm_gaudi_platform.plugins.general_plugin(entry_point)`.
    Building it imports nothing: `module` imports vLLM's layers.
    """

    def register() -> None:
        replace_ops(importlib.import_module(module).REPLACEMENTS)

    register.__name__ = register.__qualname__ = entry_point
    register.__module__ = "vllm_gaudi_ops.register"
    register.__doc__ = (
        f"{entry_point}: replace the vLLM CustomOp classes listed in {module}.REPLACEMENTS "
        "with their Gaudi subclasses.\n\n"
        "Does nothing but log one line when vLLM's active platform is not HPU (real or "
        "emulated), and warns instead when the installed vLLM is outside the supported range. "
        "Idempotent."
    )
    return general_plugin(entry_point)(register)
