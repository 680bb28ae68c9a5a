"""The bucket file (``VLLM_BUCKETING_FROM_FILE``): Intel's format, read as the exact warmup list
(format and rules: the package docstring, ``bucketing/__init__.py``)."""

from __future__ import annotations

import ast
import logging
import math
from itertools import product

from vllm_gaudi_platform.bucketing.buckets import Bucket, BucketPlan
from vllm_gaudi_platform.bucketing.grid import decode_bucket
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.envs import VLLM_BUCKETING_FROM_FILE, EnvError

logger = logging.getLogger(f"vllm.{__name__}")

FILE_STRATEGY = "file"
# A bucket-file line expanding to more buckets than this is surely a mistake.
MAX_BUCKETS_PER_FILE_LINE = 100_000


def _file_error(path: str, line_no: int, line: str, problem: str) -> EnvError:
    return EnvError(
        f"{VLLM_BUCKETING_FROM_FILE}={path!r}, line {line_no} ({line.strip()!r}): {problem}. "
        "Each line must be (batch_size, query_len, ctx_blocks), each item an integer, a list of "
        "integers or range(start, stop[, step]), e.g. (1, [256, 512], range(0, 8, 2)); fix the "
        "line or unset the variable."
    )


def _file_item(node: ast.expr, fail) -> list[int]:
    def literal(n: ast.expr) -> int:
        try:
            value = ast.literal_eval(n)
        except ValueError:
            raise fail("only integers, lists of integers and range(...) are allowed") from None
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(f"{value!r} is not an integer")
        return value

    if isinstance(node, ast.List):
        values = [literal(e) for e in node.elts]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        if node.keywords or not 1 <= len(node.args) <= 3:
            raise fail("range takes 1 to 3 integer arguments")
        args = [literal(a) for a in node.args]
        if len(args) == 3 and args[2] == 0:
            raise fail("a range step cannot be 0")
        values = list(range(*args))
    else:
        values = [literal(node)]
    if not values:
        raise fail("an item is empty")
    return values


def read_bucket_file(path: str) -> list[tuple[int, int, int]]:
    """Every (batch_size, query_len, ctx_blocks) a bucket file lists; EnvError when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(
            f"{VLLM_BUCKETING_FROM_FILE}={path!r} cannot be read ({exc}); point it at a readable "
            "bucket file or unset it to generate the buckets."
        ) from None
    shapes: list[tuple[int, int, int]] = []
    for line_no, line in enumerate(text.splitlines(), 1):
        source = line.split("#", 1)[0].strip()
        if not source:
            continue

        def fail(problem: str, line_no=line_no, line=line) -> EnvError:
            return _file_error(path, line_no, line, problem)

        try:
            node = ast.parse(source, mode="eval").body
        except SyntaxError:
            raise fail("not a tuple") from None
        if not isinstance(node, ast.Tuple) or len(node.elts) != 3:
            raise fail("not a tuple of three items")
        items = [_file_item(e, fail) for e in node.elts]
        if math.prod(len(i) for i in items) > MAX_BUCKETS_PER_FILE_LINE:
            raise fail(f"expands to more than {MAX_BUCKETS_PER_FILE_LINE} buckets")
        for floor, values, name in zip((1, 1, 0), items, ("batch_size", "query_len", "ctx_blocks")):
            if min(values) < floor:
                raise fail(f"{name} must be >= {floor}")
        shapes.extend((b, q, c) for b, q, c in product(*items))
    return shapes


def _file_buckets(path: str, lim: Limits) -> tuple[list[Bucket], list[Bucket]]:
    prompt, decode, dropped = [], [], []
    for b, q, c in read_bucket_file(path):
        if q == 1:
            bucket = decode_bucket(b, c, lim)
            if bucket is None:
                dropped.append((b, q, c))
            else:
                decode.append(bucket)
        elif b * q > lim.max_num_batched_tokens or c > lim.prompt_ctx_max:
            dropped.append((b, q, c))
        else:
            prompt.append(Bucket("prompt", b, q, c))
    if dropped:
        logger.warning(
            "%s: dropped %d bucket(s) no step within the engine limits can use "
            "(batch_size * query_len > max_num_batched_tokens, context beyond max_model_len, "
            "or fewer decode blocks than sequences): %s",
            VLLM_BUCKETING_FROM_FILE,
            len(dropped),
            sorted(set(dropped)),
        )
    for phase, found, example in (
        ("prompt", prompt, "(1, 128, 0)"),
        ("decode", decode, "(1, 1, 4)"),
    ):
        if not found:
            raise EnvError(
                f"{VLLM_BUCKETING_FROM_FILE}={path!r} gives no usable {phase} bucket; add at "
                f"least one line such as {example} (query_len 1 marks a decode bucket)."
            )
    return prompt, decode


def file_plan(path: str, lim: Limits) -> BucketPlan:
    """The plan of the buckets a bucket file lists."""
    prompt, decode = _file_buckets(path, lim)
    return BucketPlan(FILE_STRATEGY, tuple(prompt), tuple(decode))
