"""The drift guard's checks, reading the ledger: does an `Upstream` row still hold in the installed
packages, and does every method of our vLLM subclasses still override one of vLLM's.

Found by walking the wheels, not listed by hand: `vllm_subclasses` imports every module of the
installed wheels (the Gaudi backend aside, which needs habana_frameworks) and returns each class
defined there with a vLLM class among its bases.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Any

from vllm_gaudi_platform.patches import Subclass, Upstream

WHEELS = ("vllm_gaudi_platform", "vllm_gaudi_ops", "vllm_gaudi_quant", "vllm_gaudi_connectors")
# Importable only where habana_frameworks is (a Gaudi, or the tests' stand-in).
NEEDS_GAUDI = "vllm_gaudi_platform.seam.gaudi"


def resolve(target: str) -> Any:
    """The object `target` ("module:Qualified.name") names; AttributeError/ImportError if gone."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def parameter_names(obj: Any) -> list[str]:
    """Parameter names of a function, method or Triton kernel, without a leading self/cls."""
    names = getattr(obj, "arg_names", None)  # a real Triton JITFunction
    if names is None:
        names = list(inspect.signature(getattr(obj, "func", obj)).parameters)
    names = list(names)
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _accepts_any_keyword(obj: Any) -> bool:
    params = inspect.signature(obj).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def problems_with(expected: Upstream) -> list[str]:
    """What no longer holds of one row in the installed packages (empty: all holds)."""
    try:
        obj = resolve(expected.target)
    except (ImportError, AttributeError) as exc:
        return [f"{expected.target} is gone ({exc}); used by {expected.used_by}"]
    problems = []
    if expected.params or expected.keywords:
        names = parameter_names(obj)
        leading = names[: len(expected.params)]
        if leading != list(expected.params):
            problems.append(
                f"{expected.target} now takes {names}, not {list(expected.params)} first; "
                f"used by {expected.used_by}"
            )
        missing = [k for k in expected.keywords if k not in names]
        if missing and not _accepts_any_keyword(getattr(obj, "func", obj)):
            problems.append(
                f"{expected.target} has no parameter {', '.join(missing)}; used by "
                f"{expected.used_by}"
            )
    if expected.mentions:
        source = inspect.getsource(obj)
        for word in expected.mentions:
            if not re.search(rf"\b{re.escape(word)}\b", source):
                problems.append(
                    f"{expected.target} no longer mentions {word}; used by {expected.used_by}"
                )
    return problems


def _is_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


def vllm_subclasses(wheels: tuple[str, ...] = WHEELS) -> dict[str, type]:
    """Every class defined in the installed wheels' modules with a vLLM class among its bases,
    by "module:Qualified.name"."""
    found: dict[str, type] = {}
    for wheel in wheels:
        if importlib.util.find_spec(wheel) is None:
            continue
        package = importlib.import_module(wheel)
        for info in pkgutil.walk_packages(package.__path__, f"{wheel}."):
            if info.name == NEEDS_GAUDI or info.name.startswith(f"{NEEDS_GAUDI}."):
                continue
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if (
                    inspect.isclass(value)
                    and value.__module__ == module.__name__
                    and any(_is_vllm(base) for base in value.__mro__[1:])
                ):
                    found[f"{value.__module__}:{value.__qualname__}"] = value
    return found


def _defined_methods(cls: type) -> dict[str, Any]:
    """Functions, class/static methods and properties defined in the body of `cls` itself."""
    kinds = (classmethod, staticmethod, property)
    return {
        name: value
        for name, value in vars(cls).items()
        if not (name.startswith("__") and name.endswith("__"))
        and (inspect.isfunction(value) or isinstance(value, kinds))
    }


def override_problems(ours: type, declared: Subclass | None = None) -> list[str]:
    """Methods of our subclass that override nothing of its vLLM bases, or that cannot take what
    the base's callers pass (a parameter name of the base missing, with no **kwargs to catch it).
    `declared` names the methods that are ours alone and the undeclared hooks vLLM calls."""
    name_of = f"{ours.__module__}:{ours.__qualname__}"
    adds = declared.adds if declared else frozenset()
    hooks = dict(declared.hooks) if declared else {}
    bases = [base for base in ours.__mro__[1:] if _is_vllm(base)]
    problems = []
    for name, value in sorted(_defined_methods(ours).items()):
        if name in adds:
            continue
        base = next((b for b in bases if name in vars(b)), None)
        if base is None and not any(hasattr(b, name) for b in bases):
            if name in hooks:
                problems += problems_with(
                    Upstream(hooks[name], f"{name_of}.{name}", mentions=(name,))
                )
                continue
            problems.append(
                f"{name_of}.{name} overrides nothing of {', '.join(b.__qualname__ for b in bases)}"
                f" (renamed upstream?); if it is ours alone, declare it in the ledger's SUBCLASSES"
            )
            continue
        base = base or next(b for b in bases if hasattr(b, name))
        upstream = inspect.getattr_static(base, name)
        if isinstance(value, property) or isinstance(upstream, property):
            continue
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        up_func = getattr(upstream, "__func__", upstream)
        if not callable(up_func):
            continue
        signature = inspect.signature(func)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            continue
        up_params = inspect.signature(up_func).parameters
        missing = [
            n
            for n in parameter_names(up_func)
            if n not in signature.parameters
            and up_params[n].kind not in (up_params[n].VAR_POSITIONAL, up_params[n].VAR_KEYWORD)
        ]
        if missing:
            problems.append(
                f"{name_of}.{name} does not take {', '.join(missing)}, which "
                f"{base.__module__}:{base.__qualname__}.{name} takes"
            )
    return problems
