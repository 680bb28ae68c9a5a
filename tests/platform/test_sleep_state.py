"""The sleep state's bookkeeping (worker/sleep_mode.py) on host tensors, no engine: level 1 gives
back the bytes the weights held when they slept, whatever was written into them in place after
loading, and only weights that came back without a copy (level 2) are reloaded from the
checkpoint. The engine end to end is tests/integration/test_sleep_mode.py (and an update, then
sleep and wake, in test_weight_update.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.worker import sleep_mode


def _reload_must_not_run() -> None:
    raise AssertionError("the checkpoint was reloaded")


def test_level1_wake_keeps_weights_written_in_place_and_never_reloads():
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    kv = torch.ones(4)
    weight.add_(100.0)  # an in-place update after loading
    state = sleep_mode.SleepState(level=1)
    state.release(sleep_mode.WEIGHTS, [weight], keep_on_host=True)
    state.release(sleep_mode.KV_CACHE, [kv], keep_on_host=False)
    assert weight.untyped_storage().nbytes() == 0 and state.asleep
    # Waking the KV cache (no copy kept) must not reload the weights either.
    for tag in sleep_mode.TAGS:
        state.restore(tag, reload=_reload_must_not_run)
    assert torch.equal(weight, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100.0)
    assert torch.equal(kv, torch.zeros(4)) and not state.asleep


@pytest.mark.parametrize("order", [sleep_mode.TAGS, tuple(reversed(sleep_mode.TAGS))])
def test_level2_wake_reloads_the_weights_once(order):
    weight, kv = torch.ones(3), torch.ones(2)
    state = sleep_mode.SleepState(level=2)
    state.release(sleep_mode.WEIGHTS, [weight], keep_on_host=False)
    state.release(sleep_mode.KV_CACHE, [kv], keep_on_host=False)
    reloads = []
    for tag in order:
        state.restore(tag, reload=lambda: reloads.append(weight.clone()))
    assert len(reloads) == 1 and torch.equal(reloads[0], torch.zeros(3))
