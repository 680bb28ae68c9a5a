"""The per-family dispatch counter, in-process and through VLLM_HPU_OPS_STATS_FILE."""

from __future__ import annotations

import json

import pytest

from vllm_gaudi_ops import stats

COUNT_TWICE = "from vllm_gaudi_ops import stats; stats.count('norm'); stats.count('rotary')"


def test_count_adds_one_per_call_for_its_family():
    before = dict(stats.COUNTS)

    stats.count("test-family")
    stats.count("test-family")

    assert stats.COUNTS["test-family"] == before.get("test-family", 0) + 2
    assert {k: v for k, v in stats.COUNTS.items() if k != "test-family"} == {
        k: v for k, v in before.items() if k != "test-family"
    }


def test_count_stays_out_of_compiled_graphs():
    # vLLM's trace-once mode drops dynamo's guards: a traced update would become a constant
    # written back by every call. Counting stays out of traced code.
    import torch

    def op(x):
        stats.count("compiled-family")
        return x + 1

    compiled = torch.compile(op, backend="eager", fullgraph=True)
    stats.COUNTS.pop("compiled-family", None)

    for _ in range(3):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert "compiled-family" not in stats.COUNTS
    op(torch.ones(2))
    assert stats.COUNTS.pop("compiled-family") == 1


def test_merge_into_file_creates_the_file(tmp_path):
    path = tmp_path / "stats.json"

    stats.merge_into_file(str(path), {"norm": 3})

    assert json.loads(path.read_text()) == {"norm": 3}


def test_merge_into_file_adds_to_the_counts_already_there(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"norm": 3, "moe": 1}))

    stats.merge_into_file(str(path), {"norm": 2, "rotary": 5})

    assert json.loads(path.read_text()) == {"norm": 5, "moe": 1, "rotary": 5}


@pytest.mark.process
def test_each_process_adds_its_counts_to_the_file_at_exit(run_python, tmp_path):
    path = tmp_path / "stats.json"

    for _ in range(2):
        result = run_python(COUNT_TWICE, env={stats.STATS_FILE_ENV: str(path)})
        assert result.returncode == 0, result.stderr

    assert json.loads(path.read_text()) == {"norm": 2, "rotary": 2}


@pytest.mark.process
def test_counts_reach_the_file_before_exit_so_a_killed_process_keeps_them(run_python, tmp_path):
    # vLLM SIGKILLs an engine process that misses its shutdown grace period; no exit handler
    # runs then. A family's first call is written at once.
    path = tmp_path / "stats.json"
    killed = COUNT_TWICE + "; import os, signal; os.kill(os.getpid(), signal.SIGKILL)"

    result = run_python(killed, env={stats.STATS_FILE_ENV: str(path)})

    assert result.returncode == -9
    assert json.loads(path.read_text()) == {"norm": 1, "rotary": 1}


@pytest.mark.process
def test_periodic_and_exit_writes_add_up_to_the_calls(run_python, tmp_path):
    path = tmp_path / "stats.json"
    many = (
        "from vllm_gaudi_ops import stats; stats.FLUSH_INTERVAL_S = 0.0\n"
        "for _ in range(7): stats.count('norm')\n"
        "stats.FLUSH_INTERVAL_S = 3600.0\n"
        "for _ in range(5): stats.count('norm')"
    )

    result = run_python(many, env={stats.STATS_FILE_ENV: str(path)})

    assert result.returncode == 0, result.stderr
    assert json.loads(path.read_text()) == {"norm": 12}


@pytest.mark.process
def test_the_last_calls_reach_the_file_an_interval_later_in_a_process_that_is_killed(
    run_python, tmp_path
):
    # `vllm serve` kills its engine-core process right after asking it to stop: the calls after
    # the last periodic write are written by a timer once the interval has passed.
    path = tmp_path / "stats.json"
    idle_then_killed = (
        "from vllm_gaudi_ops import stats; import os, signal, time\n"
        "stats.FLUSH_INTERVAL_S = 0.2\n"
        "for _ in range(5): stats.count('norm')\n"
        "time.sleep(1.5)\n"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )

    result = run_python(idle_then_killed, env={stats.STATS_FILE_ENV: str(path)})

    assert result.returncode == -9
    assert json.loads(path.read_text()) == {"norm": 5}


@pytest.mark.process
def test_a_forked_child_writes_its_own_calls_and_the_parent_its_own(run_python, tmp_path):
    # vLLM forks its engine-core process from the API server: the child neither writes the
    # parent's unwritten calls again nor waits on the parent's timer, which it does not have.
    path = tmp_path / "stats.json"
    fork = (
        "from vllm_gaudi_ops import stats; import os, signal, time\n"
        "stats.FLUSH_INTERVAL_S = 0.2\n"
        "stats.count('norm'); stats.count('norm')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    for _ in range(3): stats.count('rotary')\n"
        "    time.sleep(1.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.waitpid(pid, 0)\n"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )

    result = run_python(fork, env={stats.STATS_FILE_ENV: str(path)})

    assert result.returncode == -9
    assert json.loads(path.read_text()) == {"norm": 2, "rotary": 3}
