"""The ledger: every write this wheel makes into another project's objects (vLLM, torch,
neural-compressor, nixl), and every private name of theirs it relies on, one module per entry.

Why a ledger in code: a write into vLLM (a module global replaced, a method swapped on an object,
a private attribute set) and a call of a private vLLM name both break silently when vLLM changes.
Each entry says what it changes, why, the vLLM releases it was checked against and when it can go,
and carries the drift-guard rows (`Upstream`) that fail when the upstream names it relies on
change. tests/platform/test_upstream_contract.py checks every row of every entry on the installed
vLLM; tests/packaging/test_patch_ledger.py scans the four wheels for writes into other projects'
objects and fails on any made outside the functions an entry names (`sites`).

Each sibling wheel keeps its own ledger of the same shape (`vllm_gaudi_ops.patches`,
`vllm_gaudi_quant.patches`, `vllm_gaudi_connectors.patches`), so an entry lives with the code it
describes.

To add an entry: a module here (named after what it patches or relies on) defining
`PATCH = Patch(...)`; name the functions that make the write in `sites`. A new vLLM release is
added to `checked_against` entry by entry, once someone has read the upstream code again.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field

# The vLLM releases every entry has been read against unless it says otherwise.
CHECKED = ("0.32.0", "0.33.0")

# The ledgers of the four wheels (those installed are read).
LEDGERS = (
    "vllm_gaudi_platform.patches",
    "vllm_gaudi_ops.patches",
    "vllm_gaudi_quant.patches",
    "vllm_gaudi_connectors.patches",
)


@dataclass(frozen=True)
class Upstream:
    """One name of another project our code relies on, and how (a drift-guard row)."""

    target: str  # "module:Qualified.name"
    used_by: str  # our code that relies on it
    params: tuple[str, ...] = ()  # leading parameters after self/cls, in order
    keywords: tuple[str, ...] = ()  # further parameters we pass by name
    mentions: tuple[str, ...] = ()  # identifiers its source must contain (attributes it sets)
    # The vLLM releases this row holds for (a version specifier; "" = every supported one): where
    # 0.32 and 0.33 differ, one row per side, named after the upstream change.
    releases: str = ""

    def __str__(self) -> str:
        return self.target + (f" [vllm{self.releases}]" if self.releases else "")

    def applies(self) -> bool:
        from vllm_gaudi_platform import compat

        found = compat.check_vllm().found
        return not self.releases or found is None or compat.in_releases(found, self.releases)


@dataclass(frozen=True)
class Patch:
    """One ledger entry."""

    what: str  # what we write or replace in another project's objects ("" = only relies on names)
    why: str
    can_go: str  # the upstream change that would let it go
    # Our functions that make the write ("module:Qualified.function"); every write the ledger
    # scan finds must sit in one of them.
    sites: tuple[str, ...] = ()
    # Where the write holds: "process" (until exit), "object" (one object), "call" (restored
    # after the call), "" for an entry that writes nothing.
    scope: str = ""
    upstream: tuple[Upstream, ...] = ()
    checked_against: tuple[str, ...] = CHECKED
    name: str = field(default="", compare=False)  # the module's name, filled by `entries`


@dataclass(frozen=True)
class Subclass:
    """What the override check must know of one of our subclasses of a vLLM class: the methods
    that are ours alone (every other method must override one of vLLM's), and the hooks vLLM
    looks up by name without declaring them (method -> "module:Qualified.name" of the vLLM code
    whose source calls it)."""

    ours: str  # "module:Class"
    adds: frozenset[str] = frozenset()
    hooks: tuple[tuple[str, str], ...] = ()


def entries(package: str = __name__) -> list[Patch]:
    """The entries of one wheel's ledger, each named after its module."""
    module = importlib.import_module(package)
    found = []
    for info in pkgutil.iter_modules(module.__path__):
        entry = getattr(importlib.import_module(f"{package}.{info.name}"), "PATCH", None)
        if entry is not None:
            object.__setattr__(entry, "name", f"{package}.{info.name}")
            found.append(entry)
    return found


def subclasses(package: str = __name__) -> list[Subclass]:
    """The subclass declarations of one wheel's ledger (its `SUBCLASSES`)."""
    return list(getattr(importlib.import_module(package), "SUBCLASSES", ()))


def installed_ledgers() -> list[str]:
    """The ledgers of the wheels installed here."""
    return [name for name in LEDGERS if importlib.util.find_spec(name.partition(".")[0])]


P = "vllm_gaudi_platform"
KV_UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"
NIXL_WORKER = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker"
)

SUBCLASSES: tuple[Subclass, ...] = (
    Subclass(f"{P}.stat_logger:HpuStatLogger", frozenset({"refresh"})),
    Subclass(
        f"{P}.platform:HpuPlatform",
        frozenset({"is_emulated", "supported_dtypes"}),
        hooks=(
            ("insert_blocks_to_device", f"{KV_UTILS}:copy_kv_blocks"),
            ("swap_out_blocks_to_host", f"{KV_UTILS}:copy_kv_blocks"),
            ("discover_numa_topology", f"{NIXL_WORKER}.__init__"),
        ),
    ),
    Subclass(
        f"{P}.worker.hpu_worker:HPUWorker",
        frozenset(
            {
                "get_recompile_stats",
                "set_compiled_forward",
                "get_sleep_report",
                "get_memory_report",
                "_check_warmup_memory",
                "finalize_calibration",
                "_sleep",
                "_kv_cache_tensors",
            }
        ),
    ),
    Subclass(
        f"{P}.worker.model_runner:HPUModelRunner",
        frozenset(
            {
                "_share_host_buffers",
                "finalize_calibration",
                "warmup_model",
                "_forward_with_metadata",
                "_graph_forward",
                "_graph_inputs",
                "_live_weights",
                "_static_metadata",
                "recapture_graphs",
                "_attention_layer_names",
                "lora_unwarmed_shapes",
                "_agree_across_dp",
                "_num_tokens_across_dp",
                "execute_idle_dp_step",
                "_run_model",
                "_rewindable_generators",
                "token_side_buffers",
                "serving_plan",
            }
        ),
    ),
    Subclass(
        f"{P}.worker.lora:PunicaWrapperHPU",
        frozenset(
            {
                "_slots",
                "_sampler_slots",
                "_shrink",
                "_expand",
                "_accumulate",
                "_record",
                "token_buffers",
            }
        ),
    ),
    Subclass(
        f"{P}.attention.metadata_builder:HPUAttentionMetadataBuilder",
        frozenset({"block_table", "state_slots"}),
    ),
    Subclass(
        f"{P}.attention.mamba_state:HPUStateMetadataBuilder",
        frozenset({"block_table", "state_slots"}),
    ),
    Subclass(f"{P}.attention.mla:HPUMLAImpl", frozenset({"_prefill"})),
    Subclass(
        f"{P}.attention.impl:HPUAttentionImpl",
        frozenset(
            {
                "_to_cells",
                "_from_cells",
                "_forward_encoder_only",
                "_encoder_prefill",
                "_kv_scales",
                "_quantize_kv",
                "_dequantize_kv",
                "_prefill",
                "_alibi_slice_mask",
                "_decode",
            }
        ),
    ),
    Subclass(f"{P}.communicator:HPUCommunicator", frozenset({"_all_gatherv_one"})),
    Subclass(
        f"{P}.distributed.weight_transfer:HpuWeightTransferEngine",
        frozenset(
            {
                "_apply",
                "_serving",
                "_not_connected",
                "report",
                "_all_workers_agree",
                "_reports_failures",
                "_vote_group",
            }
        ),
    ),
)
