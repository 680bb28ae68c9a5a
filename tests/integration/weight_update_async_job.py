"""A weight update during traffic, in one served-style engine (AsyncLLM, its engine core in a
process of its own): requests stream, vLLM's pause_generation(mode="wait") lets the in-flight ones
finish while new ones queue, the trainer's round is written, and after resume the queued requests
run on the new weights. Prints one RESULT JSON line.

    python weight_update_async_job.py '<json job>'

Job keys: model, prompts, max_tokens (the requests queued during the pause), long_tokens (the
in-flight ones), engine (engine arguments), workdir, timeout_s. The result holds each batch's
completions (engine_job.completion), how many in-flight requests were unfinished when the pause
began, and the worker's recompile statistics.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


async def run(job: dict) -> dict:
    from engine_job import completion
    from vllm import SamplingParams
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.exceptions import RetryableRequestError
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    from weight_update_job import start_trainer

    args = AsyncEngineArgs(
        model=job["model"],
        weight_transfer_config=WeightTransferConfig(backend="hpu"),
        **job["engine"],
    )
    engine = AsyncLLM.from_engine_args(args)
    import vllm

    out: dict = {"vllm": vllm.__version__}
    first_token = asyncio.Event()

    resumed = asyncio.Event()
    out["refused_while_paused"] = 0

    async def generate(tag: str, prompt: list[int], max_tokens: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
        while True:
            final = None
            try:
                async for output in engine.generate(
                    TokensPrompt(prompt_token_ids=prompt), params, tag
                ):
                    first_token.set()
                    final = output
            except RetryableRequestError:
                # vLLM 0.33 refuses requests while paused (mode "wait"), to be retried after
                # resume; vLLM 0.32 queues them. A client of either loses none.
                out["refused_while_paused"] += 1
                await resumed.wait()
                continue
            assert final is not None
            return completion(final)

    trainer, info = start_trainer(
        job, [{"seed": 1, "scale": 0.5, "bucket_bytes": 4096, "save": job["workdir"] + "/round0"}]
    )
    try:
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        in_flight = [
            asyncio.create_task(generate(f"old-{i}", p, job["long_tokens"]))
            for i, p in enumerate(job["prompts"])
        ]
        await first_token.wait()
        out["unfinished_at_pause"] = sum(not t.done() for t in in_flight)
        pause = asyncio.create_task(engine.pause_generation(mode="wait", clear_cache=True))
        await asyncio.sleep(0.05)
        queued = [  # submitted while the engine is paused: queued, or refused to be retried
            asyncio.create_task(generate(f"new-{i}", p, job["max_tokens"]))
            for i, p in enumerate(job["prompts"])
        ]
        await pause
        out["in_flight_done_when_paused"] = all(t.done() for t in in_flight)
        out["queued_done_when_paused"] = sum(t.done() for t in queued)
        start = time.perf_counter()
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={}))
        await engine.finish_weight_update()
        out["update_seconds"] = time.perf_counter() - start
        await engine.resume_generation()
        resumed.set()
        out["in_flight"] = [await t for t in in_flight]
        out["queued"] = [await t for t in queued]
        out["stats"] = (await engine.collective_rpc("get_recompile_stats"))[0]
        out["trainer_rc"] = trainer.wait(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        engine.shutdown()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    result = asyncio.run(run(json.loads(sys.argv[1])))
    print("RESULT " + json.dumps(result), flush=True)
