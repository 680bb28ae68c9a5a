"""Registering a Gaudi class as the out-of-tree replacement of a vLLM CustomOp class."""

from __future__ import annotations

from vllm_gaudi_platform.plugins import register_custom_op


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
