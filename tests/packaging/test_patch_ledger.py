"""Nothing writes into another project's objects outside the ledger.

The scan reads the source of the four wheels and finds every write that lands in an object of
another project (vLLM, torch, neural-compressor, nixl, ...):
- an attribute or item set or deleted on an imported module or object, or on a module fetched
  by `importlib.import_module` / `sys.modules`, or on a local taken from one of them;
- a field of vLLM's forward context (`get_forward_context()`, or a `context` parameter);
- `setattr` / `delattr` on anything but `self` / `cls`;
- a method replaced on an object (a local function, a lambda or one of our bound methods
  assigned to another object's attribute);
- an object's `__class__`;
- a private attribute (`x._name`) set on an object that is not ours (no class of the wheels
  defines that name).
Each such write must sit in a function some ledger entry names in its `sites`
(`vllm_gaudi_platform.patches` and its siblings), and every site an entry names must exist.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

from vllm_gaudi_platform import patches

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(ROOT.glob("packages/*/src/*"))
FOREIGN = (
    "vllm",
    "torch",
    "neural_compressor",
    "nixl",
    "transformers",
    "sys",
    "builtins",
    "importlib",
    "ray",
    "triton",
    "habana_frameworks",
)
FORWARD_CONTEXT_PARAMS = ("context", "forward_context")
# Entries whose write the scan cannot see in the source, and why.
UNSEEN = {
    # a registration through the other project's own API (a call, not an attribute write)
    "vllm_gaudi_platform.patches.triton_kernels": "vLLM's kernel override registry",
    "vllm_gaudi_quant.patches.inc_patched_modules": "neural-compressor's patched-module table",
    # a public field of a config object, raised and restored
    "vllm_gaudi_platform.patches.token_budget": "scheduler_config.max_num_batched_tokens",
    # a public attribute of layers found by walking the loaded model (a parameter, not an import)
    "vllm_gaudi_platform.patches.chunked_local": "ChunkedLocalAttention.attn_backend",
}


@dataclass(frozen=True)
class Write:
    site: str  # "module:Qualified.function" (the outermost function holding the write)
    line: int
    code: str
    kind: str


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def own_names(trees: list[ast.Module]) -> tuple[set[str], set[str]]:
    """Attribute names the wheels' own classes define (class bodies, `self.x = ...`), and the
    names of their methods."""
    attributes: set[str] = set()
    methods: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attributes.add(item.name)
                        methods.add(item.name)
                    elif isinstance(item, ast.ClassDef):
                        attributes.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attributes.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                attributes.add(node.attr)
    return attributes, methods


def scan(module: str, tree: ast.Module, own: tuple[set[str], set[str]]) -> list[Write]:
    """The writes into other projects' objects in one module's source."""
    own_attributes, own_methods = own
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FOREIGN:
                    foreign.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and node.module
            and node.module.split(".")[0] in FOREIGN
        ):
            foreign.update(a.asname or a.name for a in node.names)
    found: list[Write] = []

    def visit(node: ast.AST, site: str | None, prefix: str, local: dict[str, str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = dict(local)
                for arg in [*child.args.args, *child.args.kwonlyargs]:
                    if arg.arg in FORWARD_CONTEXT_PARAMS:
                        inner[arg.arg] = "forward context"
                for sub in ast.walk(child):
                    if (
                        isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and sub is not child
                    ):
                        inner[sub.name] = "function"
                visit(child, site or f"{module}:{prefix}{child.name}", prefix, inner)
            elif isinstance(child, ast.ClassDef):
                visit(child, site, f"{prefix}{child.name}.", local)
            else:
                check(child, site or f"{module}:<module>", local)
                visit(child, site, prefix, local)

    def remember(node: ast.AST, local: dict[str, str]) -> None:
        if not isinstance(node, ast.Assign):
            return
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        value = node.value
        origin = ""
        if isinstance(value, ast.Call):
            func = value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            origin = {"import_module": "module", "get_forward_context": "forward context"}.get(
                called, ""
            )
        elif isinstance(value, ast.Subscript) and ast.unparse(value.value) == "sys.modules":
            origin = "module"
        elif isinstance(value, ast.Attribute):
            base = _root(value)
            if isinstance(base, ast.Name) and base.id in foreign:
                origin = "module"
            elif isinstance(base, ast.Name) and local.get(base.id) in ("module", "forward context"):
                origin = local[base.id]
        for name in names:
            if origin:
                local[name] = origin

    def kind_of(target: ast.expr, value: ast.expr | None, local: dict[str, str]) -> str:
        root = _root(target)
        rid = root.id if isinstance(root, ast.Name) else ""
        if rid in foreign or local.get(rid) == "module":
            return "an object of another project"
        if local.get(rid) == "forward context":
            return "vLLM's forward context"
        if not isinstance(target, ast.Attribute):
            return ""
        if target.attr == "__class__":
            return "an object's class"
        replaced = isinstance(value, ast.Lambda) or (
            isinstance(value, ast.Name) and local.get(value.id) == "function"
        )
        if rid in ("self", "cls"):
            # self.x.y = self.method: one of our methods put on another object
            ours = (
                isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id == "self"
                and value.attr in own_methods
            )
            deep = isinstance(target.value, ast.Attribute)
            return "a method replaced on an object" if deep and (ours or replaced) else ""
        if replaced:
            return "a method replaced on an object"
        private = target.attr.startswith("_") and not target.attr.startswith("__")
        if private and target.attr not in own_attributes:
            return "a private attribute of another project's object"
        return ""

    def check(node: ast.AST, site: str, local: dict[str, str]) -> None:
        remember(node, local)
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                kind = kind_of(target, value, local)
                if kind:
                    found.append(Write(site, node.lineno, ast.unparse(target), kind))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Name) and call.func.id in ("setattr", "delattr"):
                first = call.args[0] if call.args else None
                if not (isinstance(first, ast.Name) and first.id in ("self", "cls")):
                    found.append(Write(site, node.lineno, ast.unparse(call)[:80], call.func.id))

    visit(tree, None, "", {})
    return found


def wheel_modules() -> dict[str, ast.Module]:
    found = {}
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = ast.parse(path.read_text())
    return found


def all_writes() -> list[Write]:
    modules = wheel_modules()
    own = own_names(list(modules.values()))
    return [write for name, tree in modules.items() for write in scan(name, tree, own)]


def ledger_sites() -> dict[str, str]:
    """Site -> the ledger entry naming it."""
    return {
        site: entry.name
        for ledger in patches.installed_ledgers()
        for entry in patches.entries(ledger)
        for site in entry.sites
    }


def test_every_write_into_another_projects_objects_is_in_the_ledger():
    sites = ledger_sites()
    outside = [
        f"{w.site} line {w.line}: {w.code} ({w.kind})" for w in all_writes() if w.site not in sites
    ]
    assert outside == [], (
        "writes into other projects' objects outside the ledger: add an entry to the wheel's "
        "`patches` package naming the function in its `sites`\n" + "\n".join(outside)
    )


def test_every_site_the_ledger_names_exists_and_writes():
    written = {w.site for w in all_writes()}
    problems = []
    for site, entry in ledger_sites().items():
        module_name, _, qualname = site.partition(":")
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            problems.append(f"{entry}: {site} does not exist")
        elif site not in written and entry not in UNSEEN:
            problems.append(f"{entry}: {site} writes nothing the scan sees")
    assert problems == []


def test_every_entry_says_what_why_and_when_it_can_go():
    for ledger in patches.installed_ledgers():
        for entry in patches.entries(ledger):
            assert entry.why and entry.can_go, entry.name
            assert bool(entry.what) == bool(entry.sites) == bool(entry.scope), (
                f"{entry.name}: an entry that writes says what, where (sites) and for how long "
                "(scope); one that only relies on names has none of the three"
            )
            assert entry.what or entry.upstream, f"{entry.name} neither writes nor relies"


SAMPLE = """
import importlib
import torch
from vllm.v1.worker import gpu_model_runner
from vllm.forward_context import get_forward_context


class Ours:
    def __init__(self, other):
        self._mine = 1
        self.other = other
        self.other.hook = self.method

    def method(self):
        pass


def process_wide():
    torch.accelerator.synchronize = print
    gpu_model_runner.group_and_batch_mm_kwargs = None


def fetched():
    module = importlib.import_module("nixl._bindings")
    module.nixlAgent = None
    config = torch._dynamo.config
    config.recompile_limit = 64


def context_fields(context):
    context.attn_metadata = {}
    ctx = get_forward_context()
    ctx.is_padding = None


def on_objects(layer, method, proxy, ours):
    def replacement():
        pass

    setattr(layer, "x", 1)
    method.apply = replacement
    method.other = lambda: None
    proxy.__class__ = int
    layer._k_scale_float = 1.0
    ours._mine = 2
    layer.weight = 3
"""


def test_the_scan_finds_each_kind_of_write_and_nothing_else():
    tree = ast.parse(SAMPLE)
    found = {(w.site.partition(":")[2], w.code) for w in scan("sample", tree, own_names([tree]))}

    assert found == {
        ("Ours.__init__", "self.other.hook"),
        ("process_wide", "torch.accelerator.synchronize"),
        ("process_wide", "gpu_model_runner.group_and_batch_mm_kwargs"),
        ("fetched", "module.nixlAgent"),
        ("fetched", "config.recompile_limit"),
        ("context_fields", "context.attn_metadata"),
        ("context_fields", "ctx.is_padding"),
        ("on_objects", "setattr(layer, 'x', 1)"),
        ("on_objects", "method.apply"),
        ("on_objects", "method.other"),
        ("on_objects", "proxy.__class__"),
        ("on_objects", "layer._k_scale_float"),
    }
