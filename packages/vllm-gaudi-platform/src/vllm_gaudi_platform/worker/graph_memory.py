"""What the plan's HPU graphs will hold, estimated in the profile run, before the KV cache is sized.

A captured HPU graph keeps device memory for as long as it lives (on a Gaudi its recorded
intermediates; the Habana stand-in keeps every tensor its recording made). Warmup captures one
graph per run of the plan, after the KV cache took what the profile run left, so the KV budget
must leave room for all of them (Intel's vllm-gaudi #1736: a hybrid model's warmup running out
of memory where a fixed share, VLLM_GRAPH_RESERVED_MEM, was too small).

The profile run captures, per bucket phase, the run of the plan with the least and the one with
the most work and reads what each holds (`seam.memory_allocated` before the capture and after
it, freed again at once). Every other run is bounded from those two samples: what a graph holds
grows with its tokens (activations) and with its attention work (scores: tokens x keys): with
held = a + p * tokens + q * work and a, p, q >= 0, the models that fit both samples form a
segment, and a run's bound is the most any of them gives it (at an end of the segment, where one
coefficient is 0). Where no such model fits (measurement noise), the larger sample is scaled by
the run's largest size ratio. The sum over the plan's runs is the estimate the worker keeps back
(at least the VLLM_GRAPH_RESERVED_MEM share); warmup then measures what the graphs really hold
and warns if it is more.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from typing import Any

from vllm_gaudi_platform.bucketing import Bucket

Run = tuple[Bucket, bool]  # (bucket, packed-prefill variant), as warmup.warmup_runs gives them


@dataclasses.dataclass(frozen=True)
class Sample:
    """A graph captured in the profile run: its run and the bytes it held."""

    run: Run
    held: int

    def as_dict(self) -> dict[str, Any]:
        bucket, packed = self.run
        return {"bucket": str(bucket), "packed": packed, "held": self.held}


def sizes(run: Run, block_size: int) -> tuple[int, int]:
    """(tokens, attention work) of a run: the padded tokens of its pass, and its score entries
    per head (each token against its keys; a decode bucket's blocks are the whole batch's)."""
    bucket, _ = run
    tokens = bucket.batch_size * bucket.query_len
    if bucket.phase == "prompt":
        work = tokens * (bucket.query_len + bucket.ctx_blocks * block_size)
    else:
        work = bucket.query_len * bucket.ctx_blocks * block_size
    return tokens, max(work, 1)


def samples_to_take(runs: Sequence[Run], block_size: int) -> list[Run]:
    """Per phase, the run with the least and the one with the most work (then tokens; the packed
    variant, which adds its mask, on a tie): at most two captures per phase."""
    chosen: list[Run] = []
    for phase in dict.fromkeys(b.phase for b, _ in runs):
        mine = [r for r in runs if r[0].phase == phase]

        def key(r: Run) -> tuple[int, int, bool]:
            tokens, work = sizes(r, block_size)
            return work, tokens, r[1]

        for run in (min(mine, key=key), max(mine, key=key)):
            if run not in chosen:
                chosen.append(run)
    return chosen


def bound(run: Run, samples: Sequence[Sample], block_size: int) -> int:
    """The most the graph of `run` can hold under held = a + p * tokens + q * work (a, p, q >= 0)
    given what its phase's samples held (see the module docstring)."""
    mine = [s for s in samples if s.run[0].phase == run[0].phase]
    if not mine:
        raise ValueError(f"no graph of phase {run[0].phase!r} was sampled")
    x = (1, *sizes(run, block_size))
    points = [((1, *sizes(s.run, block_size)), s.held) for s in mine[:2]]
    # The models that fit both samples form a segment; its end points (one coefficient 0) give
    # the most. Each pair of coefficients is solved from the two samples (Cramer's rule).
    best = None
    if len(points) == 2:
        (u, hu), (v, hv) = points
        for i, j in ((0, 1), (0, 2), (1, 2)):
            det = u[i] * v[j] - u[j] * v[i]
            if det == 0:
                continue
            ci = (hu * v[j] - hv * u[j]) / det
            cj = (u[i] * hv - v[i] * hu) / det
            if ci >= 0 and cj >= 0:
                value = ci * x[i] + cj * x[j]
                best = value if best is None else max(best, value)
    if best is None:  # one sample, or none of the pairs fits (measurement noise): scale
        held = max(h for _, h in points)
        largest = max(points, key=lambda point: point[0][2])[0]
        best = held * max(1.0, *(xd / ld for xd, ld in zip(x[1:], largest[1:])))
    return int(-(-best // 1))


def estimate(runs: Sequence[Run], samples: Sequence[Sample], block_size: int) -> int:
    """What the graphs of all `runs` hold together, at most."""
    return sum(bound(run, samples, block_size) for run in runs)


def sample(runner: Any, runs: Sequence[Run]) -> list[Sample]:
    """Capture each of `runs` alone as warmup would (no draft head) and read what its graph
    holds; the graph is dropped before the next. The runner's graphs must be enabled."""
    from vllm_gaudi_platform.worker import warmup

    seam, graphs = runner.seam, runner.graphs
    seconds = graphs.stats.capture_seconds
    taken = []
    # The first capture of a process also allocates what stays for every later one (the
    # allocator's and the interpreter's arenas): the first run is captured once unmeasured.
    for i, (bucket, packed) in enumerate([runs[0], *runs] if runs else []):
        gc.collect()
        seam.synchronize()
        before = seam.memory_allocated()
        warmup.run_bucket(runner, bucket, 0, packed=packed)
        seam.synchronize()
        gc.collect()
        held = seam.memory_allocated() - before
        graphs.clear()
        if i:
            taken.append(Sample((bucket, packed), max(held, 0)))
    gc.collect()
    graphs.stats.captured = 0
    graphs.stats.capture_seconds = seconds
    return taken
