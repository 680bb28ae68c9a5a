"""The entry point: ``plan_from_env`` builds the bucket plan the environment asks for.

A bucket file (``VLLM_BUCKETING_FROM_FILE``) wins; otherwise ``VLLM_BUCKETING_STRATEGY`` names a
strategy in ``STRATEGY_PLANS``. A new strategy is a module with a ``(Env, Limits) -> BucketPlan``
function and one line in that table (rules: the package docstring, ``bucketing/__init__.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from vllm_gaudi_platform.bucketing.buckets import BucketPlan
from vllm_gaudi_platform.bucketing.exp import exp_plan
from vllm_gaudi_platform.bucketing.file import file_plan
from vllm_gaudi_platform.bucketing.fitted import FITTED_STRATEGY, fitted_plan
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.lin import lin_plan
from vllm_gaudi_platform.bucketing.pad import pad_plan
from vllm_gaudi_platform.bucketing.settings import Env, read_strategy
from vllm_gaudi_platform.envs import VLLM_BUCKETING_FROM_FILE

# Strategy name (VLLM_BUCKETING_STRATEGY) -> the function that builds its plan.
STRATEGY_PLANS: dict[str, Callable[[Env, Limits], BucketPlan]] = {
    "exp": exp_plan,
    "lin": lin_plan,
    "pad": pad_plan,
    FITTED_STRATEGY: fitted_plan,
}
STRATEGIES = tuple(STRATEGY_PLANS)


def plan_from_env(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_kv_blocks: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> BucketPlan:
    """Build the plan from the environment (environ defaults to os.environ).

    Raises EnvError on bad input, naming the variable and the fix.
    ``num_kv_blocks`` (when known, after the KV cache is sized) caps the decode block range at
    3x the physical blocks. Warnings are logged for ignored or deprecated settings.
    """
    lim = Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_kv_blocks)
    env = Env(os.environ if environ is None else environ)
    env.warn_unknown()
    strategy = read_strategy(env, STRATEGIES)
    env.validate_all()
    path = env.raw(VLLM_BUCKETING_FROM_FILE)
    if path is not None:
        return file_plan(path.strip(), lim)
    return STRATEGY_PLANS[strategy](env, lim)
