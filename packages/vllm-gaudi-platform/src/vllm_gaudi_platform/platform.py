"""HpuPlatform: vLLM's view of an Intel Gaudi, real or emulated on the CPU."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_gaudi_platform import config_checks, envs, quant_hooks
from vllm_gaudi_platform.attention.cache_dtypes import (
    HPU_KV_CACHE_DTYPES,
    VLLM_UINT8_FP8_CACHE_DTYPES,
)
from vllm_gaudi_platform.observability import metrics as hpu_metrics
from vllm_gaudi_platform.seam import backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

# Loggers live under `vllm.` (f"vllm.{__name__}"): vLLM configures handlers for that tree only.


class _Seam:
    """The seam's backend, resolved on first use rather than at import.

    vLLM imports this module in processes where the HPU platform is not (or not yet) the active
    platform: a stat-logger or general plugin checking which platform is active, `doctor`, a test.
    Importing it must not raise on a machine with no Gaudi and no emulation; the first attribute
    read, which happens when the platform is activated, raises `backend()`'s message instead.
    """

    active: Any = None  # the backend the platform was activated with (HpuPlatform.__init__)

    def __getattr__(self, name: str):
        return getattr(_Seam.active or backend(), name)


class _SeamConstant:
    """Descriptor for a class attribute vLLM reads off the platform (device type, dist backend,
    compile backend): the seam's constant `name`, read when vLLM reads it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> str:
        return getattr(_Seam.active or backend(), self.name)


_seam = _Seam()
ATTENTION_BACKEND_CLS = "vllm_gaudi_platform.attention.backend.HPUAttentionBackend"
# DeepSeek-style multi-head latent attention (MLA) layers.
MLA_BACKEND_CLS = "vllm_gaudi_platform.attention.mla.HPUMLABackend"
# Set to 1 in Ray workers so Ray does not narrow HABANA_VISIBLE_MODULES to the actor's own module.
RAY_NOSET_VISIBLE_MODULES = "RAY_EXPERIMENTAL_NOSET_HABANA_VISIBLE_MODULES"


def _register_attention_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND_CLS)


WORKER_CLS = "vllm_gaudi_platform.worker.hpu_worker.HPUWorker"
COMMUNICATOR_CLS = "vllm_gaudi_platform.communicator.HPUCommunicator"
DEFAULT_BLOCK_SIZE = 128

_register_attention_backend()


def _route_torch_accelerator_to_seam() -> None:
    """vLLM's shared code calls torch.accelerator (empty_cache, synchronize) in every process;
    where torch has no accelerator (emulation, or the Gaudi backend over the test stand-in, whose
    device is CPU memory) those calls go to the seam's device. Habana's package registers the
    HPU as torch's accelerator, so on a Gaudi nothing is patched.

    A process-wide patch: its ledger entry (patches/torch_accelerator.py) says why and
    when it can go."""

    def empty_cache() -> None:  # a distinct function: dynamo keys its handlers on identity
        return None

    def synchronize(*args, **kwargs) -> None:
        _seam.synchronize()

    def empty_host_cache() -> None:
        return None

    torch.accelerator.empty_cache = empty_cache
    torch.accelerator.empty_host_cache = empty_host_cache
    torch.accelerator.synchronize = synchronize


def _activate(seam) -> None:
    # From here on this process's platform answers from this backend, as vLLM's current_platform
    # is resolved once per process: a later change of the environment does not move it.
    _Seam.active = seam
    if not torch.accelerator.is_available():
        _route_torch_accelerator_to_seam()


class _RegisteredQuantization:
    """Descriptor: reads as `plugins.registered_quantization()` on the class and its instances."""

    def __get__(self, obj: object, owner: type | None = None) -> list[str]:
        from vllm_gaudi_platform.plugins import registered_quantization

        return registered_quantization()


class HpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "hpu"
    # In emulation the tensors live on the CPU; the platform is still HPU (its worker, runner,
    # attention, bucketing and kernels), only the seam below it differs.
    device_type: str = _SeamConstant("DEVICE_TYPE")  # type: ignore[assignment]
    dispatch_key: str = _SeamConstant("DISPATCH_KEY")  # type: ignore[assignment]
    # vLLM's Ray executor places one worker per Ray "HPU" resource (Ray detects Gaudis itself; a
    # CPU-only cluster must declare them, e.g. `ray start --head --resources='{"HPU": 2}'`) and
    # picks the module by local rank, so Ray must leave HABANA_VISIBLE_MODULES alone.
    ray_device_key: str = "HPU"
    ray_noset_device_env_vars: list[str] = [RAY_NOSET_VISIBLE_MODULES]
    dist_backend: str = _SeamConstant("DIST_BACKEND")  # type: ignore[assignment]
    device_control_env_var: str = envs.HABANA_VISIBLE_MODULES
    simple_compile_backend: str = _SeamConstant("COMPILE_BACKEND")  # type: ignore[assignment]
    # The methods vllm-gaudi-quant registered in this process, computed at each read. Never an
    # empty list standing for "anything": verify_quantization refuses every other method.
    supported_quantization: list[str] = _RegisteredQuantization()  # type: ignore[assignment]

    def __init__(self) -> None:
        # vLLM instantiates the platform class once per process, when it resolves
        # current_platform: that is where the HPU platform is activated, so the backend is
        # resolved here (raising its reason when there is none) and emulation's process-wide
        # routing is installed.
        super().__init__()
        _activate(backend())

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check for misspelt VLLM_* variables, knowing ours: every variable declared in
        `envs.py` (VLLM_HPU_EMULATION, the bucketing ranges, ...) is a known name, not a warning
        (or, with hard_fail, an error) about an unknown vLLM variable."""
        from vllm import envs as vllm_envs

        for name in os.environ:
            if (
                name.startswith("VLLM_")
                and name not in vllm_envs.environment_variables
                and name not in envs.VARIABLES
            ):
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable detected: {name}")
                logger.warning("Unknown vLLM environment variable detected: %s", name)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"dtype {dtype} is not supported on HPU; use dtype='bfloat16' (Gaudi's native "
                "type) or 'float32'."
            )

    @classmethod
    def is_emulated(cls) -> bool:
        return bool(_seam.IS_EMULATED)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return _seam.device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _seam.mem_get_info()[1]

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(_seam.memory_allocated())

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        _seam.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        # Gaudi's graph mode works with no_grad; inference tensors cannot be reused as static
        # graph inputs across steps.
        return torch.no_grad()

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        # HPUWorker.sleep/wake_up release and restore device memory per storage (sleep_mode.py).
        return True

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return _seam.PIN_MEMORY

    @classmethod
    def import_kernels(cls) -> None:
        # Never vllm._C: on the CPU engine build it dies with SIGILL on CPUs without AVX-512, and
        # no Gaudi code path needs it. Our kernels come through the seam.
        return None

    @classmethod
    def import_ir_kernels(cls) -> None:
        return None

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """Plain-torch stand-ins for the Triton kernels vLLM's shared runner code calls."""
        from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

        triton_kernels.register()

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_sparse", False):
            raise NotImplementedError(
                "Sparse attention (the indexer-selected MLA of DeepSeek-V3.2 and GLM-5) is not "
                "supported on HPU: serve a model with dense attention."
            )
        if getattr(attn_selector_config, "use_mla", False):
            return MLA_BACKEND_CLS
        return ATTENTION_BACKEND_CLS

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        # HPU MLA runs prefill inside its own backend (mla.py); vLLM's MLA layer still asks for
        # a prefill backend class when it is built.
        from vllm_gaudi_platform.attention.mla import HPUMLAPrefillBackend

        return HPUMLAPrefillBackend

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return COMMUNICATOR_CLS

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # Static-shape multi-LoRA through the seam's batched shrink/expand kernels.
        return "vllm_gaudi_platform.worker.lora.PunicaWrapperHPU"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Under torch.compile the attention backend is traced into the bucket's graph (its
        # branches become guards); otherwise attention is vLLM's opaque custom op.
        from vllm.config import get_current_vllm_config_or_none

        from vllm_gaudi_platform.worker.compiled import compile_wanted

        config = get_current_vllm_config_or_none()
        return config is None or not compile_wanted(config)

    # Set by check_and_update_config, which vLLM runs just before it asks support_hybrid_kv_cache
    # (with no config at hand).
    _checking_mamba_hybrid = False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Models with Mamba state next to attention need vLLM's hybrid KV-cache manager (one
        # group per layer kind). Every other model keeps one group: sliding-window layers share
        # the full-attention layers' blocks, as they always have here.
        return cls._checking_mamba_hybrid

    @classmethod
    def use_all_gather(cls) -> bool:
        return True

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        from vllm_gaudi_platform.plugins import OUTCOMES, QUANT_METHODS

        supported = cls.supported_quantization
        if quant in supported:
            return
        # A method whose vllm-gaudi-quant entry point was skipped in this process (a missing
        # optional package, ...): say why now, rather than let vLLM's own method of that name
        # fail later with a message about checkpoint files.
        for entry_point, methods in QUANT_METHODS.items():
            outcome = OUTCOMES.get(entry_point)
            if quant in methods and outcome is not None and outcome != "registered":
                raise ValueError(
                    f"--quantization {quant} is not available on HPU: {entry_point} {outcome}"
                )
        # Anything else (vLLM's GGUF, bitsandbytes, MXFP4, ... or a method whose entry point is
        # not installed or not loaded) would reach CUDA/CPU kernels: refuse it before any engine.
        raise ValueError(
            f"Quantization method {quant!r} is not supported on HPU; the methods registered in "
            f"this process are: {', '.join(supported) or 'none (install vllm-gaudi-quant)'}."
        )

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        from vllm_gaudi_platform.worker import hybrid

        HpuPlatform._checking_mamba_hybrid = hybrid.check_vllm_config(vllm_config)
        if cache_config.cache_dtype not in HPU_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={cache_config.cache_dtype!r} is not supported on HPU; use one of "
                f"{', '.join(HPU_KV_CACHE_DTYPES)} (fp8_inc, fp8 and fp8_e4m3 store the KV cache "
                "in FP8 E4M3 with per-layer scales)."
            )
        if cache_config.cache_dtype in VLLM_UINT8_FP8_CACHE_DTYPES:
            # vLLM allocates these as uint8 bytes for CUDA kernels; Gaudi's cache holds FP8 E4M3
            # as a real float8 tensor, which is what fp8_inc names.
            logger.info(
                "kv_cache_dtype=%r: the KV cache is stored as Gaudi's FP8 E4M3 (fp8_inc).",
                cache_config.cache_dtype,
            )
            cache_config.cache_dtype = "fp8_inc"
        # A quantization method may refuse settings it cannot run, before any engine starts.
        if isinstance(vllm_config.quant_config, quant_hooks.ChecksVllmConfig):
            vllm_config.quant_config.hpu_check_vllm_config(vllm_config)
        from vllm_gaudi_platform.worker.spec_decode import check_speculative_config

        check_speculative_config(vllm_config.speculative_config)

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
        parallel_config.disable_custom_all_reduce = True
        # Gaudi's runtime (and a torch that already holds threads) cannot be forked safely.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        config_checks.check_async_scheduling(vllm_config)

        compilation_config = vllm_config.compilation_config
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        compilation_config.cudagraph_capture_sizes = []
        # vLLM defaults custom ops to "none" under torch.compile; the Gaudi kernels live in the
        # ops wheel's forward_oot, so turn them on unless the operator trimmed them.
        if not compilation_config.custom_ops:
            compilation_config.custom_ops = ["all"]
        # vLLM's own compile integration stays off: its modes drop dynamo's guards (a trace of
        # one bucket would serve every other) or compile for inductor and CUDA graphs. The
        # runner compiles the forward pass itself with the seam's backend, once per bucket, in
        # eager mode (PT_HPU_LAZY_MODE=0) unless enforce_eager (worker/compiled.py); lazy mode
        # builds its graphs op by op and replays HPU graphs instead.
        config_checks.check_compile_settings(vllm_config)
        compilation_config.mode = CompilationMode.NONE
        _set_gaudi_runtime_env()
        if parallel_config.use_ray:
            from vllm_gaudi_platform.distributed import ray_cluster

            ray_cluster.prepare(parallel_config, emulated=bool(_seam.IS_EMULATED))
        config_checks.check_bucketing(vllm_config)
        config_checks.whole_images_for_mm_prefix(vllm_config)
        config_checks.hpu_offloading_specs(vllm_config)

        model_config = vllm_config.model_config
        if model_config is not None and config_checks.float16_runs_in_bfloat16(model_config):
            # Gaudi computes in bfloat16 natively; float16 checkpoints run in bfloat16 (same
            # exponent range as float32, so no overflow where float16 would have been exact).
            logger.warning(
                "float16 is not a native Gaudi type: running %s in bfloat16 "
                "(dtype='float32' keeps full precision).",
                model_config.model,
            )
            model_config.dtype = torch.bfloat16

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        # vLLM would otherwise replace an unspecified block size by its generic default (16)
        # after check_and_update_config; Gaudi's paged attention is built around 128.
        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        from vllm_gaudi_platform.worker.hybrid import is_mamba_hybrid

        if is_mamba_hybrid(vllm_config.model_config):
            # Attention blocks and Mamba state slots share one page size: vLLM grows the
            # attention block (in steps of the backend's block size) until a page holds a
            # layer's Mamba state, and pads the state to that page.
            backends = cls._find_non_ssm_backends(vllm_config)
            if backends:
                cls._align_hybrid_block_size(vllm_config, backends[0])

    @classmethod
    def log_warnings(cls) -> None:
        if _seam.IS_EMULATED:
            logger.info("HPU platform active: Gaudi kernels %s (no Gaudi device used)", _seam.NAME)

    # ------------------------------------------------------------------ NIXL (KV transfer)
    # vLLM's NixlConnector looks these up by `device_type` ("hpu" on a Gaudi, "cpu" in
    # emulation). The HPU KV cache is device memory on both backends: with kv_buffer_device
    # "cpu", HpuNixlConnector stages blocks through host buffers with swap_out_blocks_to_host /
    # insert_blocks_to_device (vLLM itself would skip staging for device type "cpu"); with
    # "hpu" and VLLM_NIXL_DEVICE_TO_DEVICE=true, NIXL reads and writes the KV cache itself.

    @classmethod
    def get_nixl_supported_devices(cls) -> dict[str, tuple[str, ...]]:
        if envs.get_bool(envs.VLLM_NIXL_DEVICE_TO_DEVICE):
            return {_seam.DEVICE_TYPE: ("cpu", "hpu")}
        return {_seam.DEVICE_TYPE: ("cpu",)}

    @classmethod
    def get_nixl_memory_type(cls) -> str | None:
        # Registered KV memory: the device's memory type when NIXL moves blocks device to device
        # (Gaudi HBM, or the emulated cache's host memory), host DRAM for staging buffers.
        if envs.get_bool(envs.VLLM_NIXL_DEVICE_TO_DEVICE):
            return _seam.NIXL_DEVICE_MEMORY
        return "DRAM"

    @classmethod
    def insert_blocks_to_device(
        cls,
        src_cache: torch.Tensor,
        dst_cache: torch.Tensor,
        src_block_indices: torch.Tensor,
        dst_block_indices: torch.Tensor,
    ) -> None:
        """Copy host staging blocks into the device KV cache (block axis first, LBNHC)."""
        _seam.copy_blocks(src_cache, dst_cache, src_block_indices, dst_block_indices)
        _seam.synchronize()
        hpu_metrics.count_staged("to_device", _block_bytes(dst_cache) * dst_block_indices.numel())

    @classmethod
    def swap_out_blocks_to_host(
        cls,
        src_cache: torch.Tensor,
        dst_cache: torch.Tensor,
        src_block_indices: torch.Tensor,
        dst_block_indices: torch.Tensor,
    ) -> None:
        """Copy device KV cache blocks into host staging buffers; done when this returns."""
        _seam.copy_blocks(src_cache, dst_cache, src_block_indices, dst_block_indices)
        # NIXL reads the host buffer right after: the device-to-host copy must have landed.
        _seam.synchronize()
        hpu_metrics.count_staged("to_host", _block_bytes(src_cache) * src_block_indices.numel())

    @classmethod
    def discover_numa_topology(cls) -> list[list[int]]:
        """Cores to reserve per NUMA node for NIXL's transfer thread: none.

        vLLM's NixlConnector calls this when the device type is "cpu" (emulation) and pins the
        worker to the returned cores. The HPU worker computes on its device (or, emulated, on
        every core it is given); pinning it to one core per node would serialize the prefill and
        decode instances of one host onto the same core.
        """
        return []


def _block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block of a block-first KV cache tensor."""
    return cache[0].numel() * cache.element_size()


def _set_gaudi_runtime_env() -> None:
    """The Gaudi runtime settings that must be fixed before the device is initialized."""
    os.environ.setdefault(envs.PT_HPU_WEIGHT_SHARING, "0")
    from vllm_gaudi_platform.worker.compiled import configure_dynamo

    configure_dynamo()
    if envs.lazy_mode():
        os.environ.setdefault("PT_HPU_ENABLE_LAZY_COLLECTIVES", "true")
    else:
        os.environ.setdefault(envs.RUNTIME_SCALE_PATCHING, "1")
