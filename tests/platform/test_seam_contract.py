"""The seam's two backends provide the same API, and that API is the `HpuBackend` Protocol.

`gaudi` cannot be imported without a Gaudi, so both backends are compared as PARSED source:
every public top-level name (function, class, constant) and every function's parameters (names,
kinds, default expressions). The Protocol is compared with the emulated backend, which imports on
any machine. A kernel added to one backend and forgotten in the other fails here.

`emulated.py` defines part of its API and re-exports the rest from its sibling `emulated_*.py`
modules, and the `gaudi` package re-exports all of its API from its modules, in the explicit form
`from vllm_gaudi_platform.seam.<module> import name as name`; a name re-exported that way is read
from the source of the module that defines it.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_gaudi_platform.seam import contract

SEAM = Path(contract.__file__).parent


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional", "vararg", "keyword-only", "varkw"
    default: str | None  # the default's source text, None when there is none


def _params(fn: ast.FunctionDef) -> tuple[Param, ...]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    out = [
        Param(p.arg, "positional", None if d is None else ast.unparse(d))
        for p, d in zip(positional, defaults)
    ]
    if a.vararg:
        out.append(Param(a.vararg.arg, "vararg", None))
    out += [
        Param(p.arg, "keyword-only", None if d is None else ast.unparse(d))
        for p, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "varkw", None))
    return tuple(out)


SEAM_PACKAGE = contract.__name__.rpartition(".")[0]


def public_api(source: str) -> dict[str, tuple[Param, ...] | str]:
    """Public top-level names of a module's source: functions map to their parameters, classes
    and constants to "class" / "value". A name re-exported from a seam module (`from
    vllm_gaudi_platform.seam.<module> import name as name`) is looked up in that module's source."""
    api: dict[str, tuple[Param, ...] | str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{SEAM_PACKAGE}."):
            reexported = [alias.name for alias in node.names if alias.asname == alias.name]
            if reexported:
                origin = node.module.removeprefix(f"{SEAM_PACKAGE}.")
                defined = public_api(_source(origin))
                for name in reexported:
                    assert name in defined, (
                        f"{name} is re-exported from {origin}.py, not defined there"
                    )
                    api[name] = defined[name]
        elif isinstance(node, ast.FunctionDef):
            api[node.name] = _params(node)
        elif isinstance(node, ast.ClassDef):
            api[node.name] = "class"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    api[target.id] = "value"
    return {name: kind for name, kind in api.items() if not name.startswith("_")}


def differences(a: dict, b: dict, a_name: str, b_name: str) -> list[str]:
    """Human-readable differences between two public APIs (empty when they agree)."""
    problems = [f"{n} is in {a_name} but not in {b_name}" for n in sorted(a.keys() - b.keys())]
    problems += [f"{n} is in {b_name} but not in {a_name}" for n in sorted(b.keys() - a.keys())]
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if isinstance(x, tuple) != isinstance(y, tuple):
            problems.append(f"{name} is a function in one backend only")
        elif isinstance(x, tuple) and x != y:
            problems.append(f"{name} signatures differ:\n  {a_name}: {x}\n  {b_name}: {y}")
    return problems


def _source(name: str) -> str:
    """The source of a seam module by its dotted name below the seam ("emulated_moe",
    "gaudi.moe"); a package's is its `__init__.py`'s."""
    path = SEAM.joinpath(*name.split("."))
    if path.is_dir():
        return (path / "__init__.py").read_text()
    return path.with_suffix(".py").read_text()


def protocol_members() -> dict[str, inspect.Signature | None]:
    """Members of HpuBackend: methods with their signature (self dropped), attributes as None."""
    members: dict[str, inspect.Signature | None] = {
        name: None for name in contract.HpuBackend.__annotations__
    }
    for name, value in vars(contract.HpuBackend).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            members[name] = None
        elif inspect.isfunction(value):
            sig = inspect.signature(value)
            members[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return members


def test_gaudi_and_emulated_backends_have_the_same_public_api():
    problems = differences(
        public_api(_source("gaudi")), public_api(_source("emulated")), "gaudi", "emulated.py"
    )
    assert not problems, "\n".join(problems)


def test_a_kernel_added_to_one_backend_only_is_reported():
    extra = "\n\ndef new_kernel(x, scale=None):\n    return x\n"
    problems = differences(
        public_api(_source("gaudi") + extra),
        public_api(_source("emulated")),
        "gaudi",
        "emulated.py",
    )
    assert problems == ["new_kernel is in gaudi but not in emulated.py"]


def test_a_changed_signature_is_reported():
    emulated_src = _source("emulated").replace(
        "def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float)",
        "def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float)",
    )
    problems = differences(
        public_api(_source("gaudi")), public_api(emulated_src), "gaudi", "emulated.py"
    )
    assert len(problems) == 1 and problems[0].startswith("rms_norm signatures differ")


def test_names_the_emulated_backend_re_exports_are_read_where_they_are_defined():
    api = public_api(_source("emulated"))
    assert api["fp8_gemm_v2"] == public_api(_source("emulated_quant"))["fp8_gemm_v2"]
    # A plain import (no `as name`) is a dependency of the module, not part of its API.
    assert "attention_with_sinks" not in api


def test_the_protocol_lists_exactly_the_backends_public_api():
    backend_names = set(public_api(_source("emulated")))
    assert set(protocol_members()) == backend_names


@pytest.mark.parametrize("name", [n for n, s in protocol_members().items() if s is not None])
def test_protocol_signatures_match_the_emulated_backend(emulated, name):
    expected = protocol_members()[name]
    actual = inspect.signature(getattr(emulated, name))
    assert [(p.name, p.kind) for p in actual.parameters.values()] == [
        (p.name, p.kind) for p in expected.parameters.values()
    ]
    assert [p.default is inspect.Parameter.empty for p in actual.parameters.values()] == [
        p.default is inspect.Parameter.empty for p in expected.parameters.values()
    ]


def test_backend_returns_the_emulated_module_under_emulation(emulated):
    from vllm_gaudi_platform import seam

    assert seam.backend() is emulated
    assert emulated.SHARED_HOST_MEMORY and not emulated.PIN_MEMORY


def test_the_device_probe_does_not_import_the_seam_package_functions():
    # The probe used to import seam/__init__ while seam/__init__ imported the probe: one place now.
    probe_src = _source("probe")
    tree = ast.parse(probe_src)
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "vllm_gaudi_platform.seam"
        for alias in node.names
    }
    assert "vllm_gaudi_platform.detection" not in imported
    assert names <= {"gaudi"}, f"probe.py imports {names} from the seam package"
