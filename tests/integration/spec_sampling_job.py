"""Samples one prompt many times with speculative decoding at temperature 1 and prints what a
distribution test of vLLM's rejection sampler on the HPU platform needs, as a RESULT JSON line.

    python spec_sampling_job.py '<json job>'

Job keys: model (path), prompt (token ids), samples (how many seeded requests),
speculative_config, engine (LLM kwargs). Each request generates two tokens: the first from the
prefill (no draft), the second from a verification step of the drafter's proposal. Reported:
every request's two tokens; for each first token seen, the target's own distribution of the next
token (top 20 logprobs of a plain request whose prompt ends with that token); vLLM's spec-decode
counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its sibling job's helpers

from spec_decode_job import _spec_metrics


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        speculative_config=job["speculative_config"],
        **{**job["engine"], "disable_log_stats": False},
    )
    prompt = job["prompt"]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=2, ignore_eos=True)
        for i in range(job["samples"])
    ]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)] * len(params), params, use_tqdm=False
    )
    pairs = [list(o.outputs[0].token_ids) for o in outs]
    firsts = sorted({p[0] for p in pairs})
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    targets = llm.generate(
        [TokensPrompt(prompt_token_ids=[*prompt, t]) for t in firsts],
        [greedy] * len(firsts),
        use_tqdm=False,
    )
    target = {
        str(t): {str(k): lp.logprob for k, lp in o.outputs[0].logprobs[0].items()}
        for t, o in zip(firsts, targets, strict=True)
    }
    return {"pairs": pairs, "target": target, "metrics": _spec_metrics(llm)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
