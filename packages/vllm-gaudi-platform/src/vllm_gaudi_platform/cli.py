"""The `vllm-gaudi` command. One subcommand per job; each is added by an `_add_<name>` function.

Importing this module is cheap (no torch, no vllm): a subcommand imports what it needs when it runs.
Importing it also keeps known third-party start-up noise off the command's screens
(`third_party_noise`), in this process and in the engine processes vLLM spawns from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from vllm_gaudi_platform.commands import third_party_noise

# At import, not in main(): a spawned engine or worker process imports the console script again
# (as __mp_main__) before anything else, and that is the one moment to install the filters there.
third_party_noise.silence()

DOCTOR_HELP = "what is installed, what will load under VLLM_PLUGINS, and why"
DOCTOR_DESCRIPTION = """\
Checks the installed vllm-gaudi-* wheels, their entry points and whether each will load under
the current VLLM_PLUGINS, the device the HPU platform would run on (a Gaudi, CPU emulation or
none), the vLLM and torch versions against the supported range, and the optional packages of
the installed wheels. Reads installed metadata only: it imports neither vllm nor torch.

Exit status: 0 when there is no problem, 1 when there is at least one. Finding no device
counts as a problem even though it is not an error of the install: you run doctor to run vLLM on
HPU, and with no Gaudi and no VLLM_HPU_EMULATION=cpu the HPU platform stays inactive and vLLM
runs on another platform. Missing optional packages are info, not problems."""


def _doctor(args: argparse.Namespace) -> int:
    from vllm_gaudi_platform.commands import doctor

    report = doctor.collect()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(doctor.render(report))
    return 0 if report.ok else 1


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help=DOCTOR_HELP,
        description=DOCTOR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (keys: wheels, entry_points, vllm_plugins, device, versions, "
        "optional, problems, info, ok)",
    )
    parser.set_defaults(run=_doctor)


def _demo(args: argparse.Namespace) -> int:
    from vllm_gaudi_platform.commands import demo

    return demo.run(max_tokens=args.max_tokens, model=args.model)


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="offline generation on the HPU platform (CPU emulation when there is no Gaudi)",
        description=(
            "Generates greedy completions of held-out Python documentation text through the HPU "
            "platform with a tiny Llama trained on that documentation on first use (about 3 "
            "minutes on 2 cores, then cached), prints its held-out perplexity through the HPU "
            "platform next to transformers' figure, the bucket plan, the warmup time and the "
            "recompile count. Uses the Gaudi when present, CPU emulation otherwise."
        ),
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument(
        "--model", default=None, help="a model path instead of the trained tiny Llama"
    )
    parser.set_defaults(run=_demo)


def _selftest(args: argparse.Namespace) -> int:
    from vllm_gaudi_platform.commands import selftest

    return selftest.run(json_path=args.json, engine=not args.no_engine)


def _add_selftest(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="check this machine's port: every kernel, the unknowns, timings, an engine",
        description=(
            "On the active backend (a Gaudi; CPU emulation when there is none): every seam "
            "kernel against its reference on the same inputs at the test suite's tolerances; a "
            "probe per device behaviour the project could not establish without hardware, with "
            "the default of ours each observation confirms or contradicts; timings our defaults "
            "rest on, as ratios, and device memory figures; the demo's model generating through "
            "the platform, its perplexity against transformers' on the host. No pytest, no "
            "downloads. Exit status 1 when a kernel disagrees with its reference (named on the "
            "screen) or the engine check fails."
        ),
    )
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="write the report (attach it to an issue)"
    )
    parser.add_argument(
        "--no-engine", action="store_true", help="skip the end-to-end generation (quicker)"
    )
    parser.set_defaults(run=_selftest)


CALIBRATE_MISSING = (
    "vllm-gaudi calibrate needs the vllm-gaudi-quant wheel with neural-compressor (INC FP8): "
    "pip install 'vllm-gaudi-quant[inc]'"
)


def _calibrate(args: argparse.Namespace) -> int:
    import importlib.util

    # Found without importing: the platform wheel never imports the quant wheel unless present.
    if (
        importlib.util.find_spec("vllm_gaudi_quant") is None
        or importlib.util.find_spec("neural_compressor") is None
    ):
        print(f"error: {CALIBRATE_MISSING}", file=sys.stderr)
        return 2
    calibrate = importlib.import_module("vllm_gaudi_quant.calibrate")
    try:
        path = calibrate.run(
            args.model,
            args.dataset,
            args.out,
            num_samples=args.num_samples,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            engine_kwargs={"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
            if args.kv_cache_memory_bytes
            else None,
        )
    except calibrate.ERRORS as exc:  # bad dataset, output directory or QUANT_CONFIG: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Calibration statistics and QUANTIZE config written: {path}")
    print(f"Serve in FP8 with: QUANT_CONFIG={path} vllm serve {args.model} --quantization inc")
    return 0


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure a model for INC FP8 and write a ready QUANTIZE config",
        description=(
            "Runs the INC FP8 MEASURE step through vLLM on the HPU platform over a dataset "
            "(JSON Lines with a 'text' or 'prompt' per line, or plain text with one sample per "
            "line), then writes the statistics and DIR/quant_config.json, to serve with "
            "QUANT_CONFIG=DIR/quant_config.json vllm serve MODEL --quantization inc. Needs "
            "vllm-gaudi-quant[inc]."
        ),
    )
    parser.add_argument("model", help="model path or name")
    parser.add_argument("--dataset", required=True, help="calibration samples (JSONL or text)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--num-samples", type=int, default=None, help="use the first N samples (default: all)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="longest sample, tokens")
    parser.add_argument("--dtype", default="auto", help="model dtype (default: the model's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default: sized from device memory, as vLLM does)",
    )
    parser.set_defaults(run=_calibrate)


def _buckets(args: argparse.Namespace) -> int:
    import os

    from vllm_gaudi_platform.commands import buckets
    from vllm_gaudi_platform.envs import EnvError

    limits = buckets.EngineLimits(
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.max_model_len,
        args.block_size,
        args.num_kv_blocks,
    )
    try:
        table, shapes = buckets.rows(limits, os.environ, args.trace, args.fractions)
    except EnvError as exc:  # an unreadable trace: one line naming it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"limits": vars(limits), "plans": [r.to_json() for r in table]}))
    else:
        print(buckets.render(limits, table, shapes, args.trace, args.list))
    return 0


def _fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not comma-separated numbers") from None
    if not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each fraction must be in (0, 1]")
    return values


def _add_buckets(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "buckets",
        help="the buckets each strategy would warm, and a trace's padding, without an engine",
        description=(
            "Prints, for the engine limits given, the bucket plan the engine would build with "
            "the current VLLM_BUCKETING_* / VLLM_PROMPT_* settings, then exp, lin and pad with "
            "the same settings: the graphs each warms, and with --trace (a file "
            "VLLM_BUCKETING_RECORD_TRACE wrote while serving) the fitted plans within exp's "
            "graph count and each --fractions of it, and the padding every plan would give the "
            "trace's steps. Starts no engine and imports neither vllm nor torch."
        ),
    )
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=128, help="KV cache block size")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache blocks, when known (the engine logs them): caps the decode buckets",
    )
    parser.add_argument("--trace", default=None, help="a recorded trace of step shapes")
    parser.add_argument(
        "--fractions",
        type=_fractions,
        default=[0.5, 0.25],
        help="graph budgets of the fitted rows, as fractions of exp's count (default 0.5,0.25)",
    )
    parser.add_argument(
        "--list", default=None, metavar="PLAN", help="also list the buckets of PLAN (e.g. exp)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=_buckets)


PROXY_MISSING = (
    "vllm-gaudi proxy is part of the vllm-gaudi-connectors wheel: pip install vllm-gaudi-connectors"
)


def _proxy(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm_gaudi_connectors") is None:
        print(f"error: {PROXY_MISSING}", file=sys.stderr)
        return 2
    proxy = importlib.import_module("vllm_gaudi_connectors.proxy")
    try:
        return proxy.serve(
            args.prefill, args.decode, args.port, args.host, args.timeout, args.api_key
        )
    except ValueError as exc:  # a bad --prefill/--decode list: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _add_proxy(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="one endpoint in front of prefill and decode instances (disaggregated serving)",
        description=(
            "Serves /v1/completions and /v1/chat/completions: each request is prefilled on a "
            "prefill instance (one token, KV kept for a remote decode), then generated on a "
            "decode instance that pulls the KV blocks through HpuNixlConnector; instances of "
            "each kind are used round robin. Needs vllm-gaudi-connectors."
        ),
    )
    parser.add_argument("--prefill", required=True, help="prefill URLs, comma-separated")
    parser.add_argument("--decode", required=True, help="decode URLs, comma-separated")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: this machine only; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=(
            "refuse requests without 'Authorization: Bearer <key>' (default: VLLM_API_KEY, as "
            "vllm serve reads it); the client's header goes on to the instances"
        ),
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a prefill or decode instance may take before the request fails (504)",
    )
    parser.set_defaults(run=_proxy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-gaudi", description="Intel Gaudi (HPU) plugins for vLLM."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_doctor(subparsers)
    _add_demo(subparsers)
    _add_selftest(subparsers)
    _add_calibrate(subparsers)
    _add_proxy(subparsers)
    _add_buckets(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vllm-gaudi` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
