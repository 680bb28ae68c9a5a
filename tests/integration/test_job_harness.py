"""The job harness's preloaded interpreter (tests/zygote.py): a forked job sees what `python
script args` would, and nothing of vLLM is imported before it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import zygote

pytestmark = pytest.mark.process

PROBE = """
import json, os, sys
print("RESULT " + json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "emulation": os.environ.get("VLLM_HPU_EMULATION"),
    "torch_preloaded": "torch" in sys.modules,
    "vllm_loaded": sorted(m for m in sys.modules if m.startswith("vllm")),
    "stdin": sys.stdin.read(),
    "main": __name__,
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def preloaded():
    """A preloaded interpreter of the module's own (the worker's may serve other environments,
    or be at its limit of two)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    interpreter = zygote.Zygote(env)
    try:
        if not interpreter.wait_ready():
            with open(interpreter.log, errors="replace") as log:
                pytest.fail(f"the preloaded interpreter did not start:\n{log.read()[-3000:]}")
        yield interpreter, env
    finally:
        interpreter.stop()


def _job(tmp_path, body: str = PROBE) -> str:
    script = tmp_path / "probe_job.py"
    script.write_text(body)
    return str(script)


def test_a_forked_job_runs_as_a_fresh_interpreter_would(preloaded, tmp_path):
    interpreter, env = preloaded
    script = _job(tmp_path)
    proc = interpreter.run([sys.executable, script, "3"], {**env, "VLLM_HPU_EMULATION": "cpu"}, 60)
    assert proc is not None
    assert proc.returncode == 3
    assert proc.stderr.endswith("to stderr\n")
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    seen = json.loads(line[len("RESULT ") :])
    assert seen["argv"] == [script, "3"]
    assert seen["path0"] == str(tmp_path) and seen["cwd"] == os.getcwd()
    assert seen["emulation"] == "cpu"  # the job's own VLLM_* variables
    assert seen["torch_preloaded"] is True
    # vLLM and the plugins are the job's to import: only what site's .pth files load at every
    # interpreter's start (the torchvision hook) is there.
    at_start = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sorted(sys.modules)))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert seen["vllm_loaded"] == [m for m in json.loads(at_start.stdout) if m.startswith("vllm")]
    assert seen["stdin"] == "" and seen["main"] == "__main__"


def test_a_job_that_raises_exits_1_with_its_traceback(preloaded, tmp_path):
    interpreter, env = preloaded
    proc = interpreter.run([sys.executable, _job(tmp_path, "raise ValueError('boom')\n")], env, 60)
    assert proc is not None and proc.returncode == 1
    assert "ValueError: boom" in proc.stderr


def test_a_job_past_its_timeout_is_killed_with_what_it_printed(preloaded, tmp_path):
    interpreter, env = preloaded
    script = _job(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        interpreter.run([sys.executable, script], env, 3)
    assert timed_out.value.stdout == "started\n"


def test_an_environment_the_preloaded_libraries_read_gets_its_own_interpreter(preloaded):
    _, env = preloaded
    assert zygote.fingerprint({**env, "VLLM_X": "1", "PT_HPU_LAZY_MODE": "0"}) == (
        zygote.fingerprint(env)
    )
    assert zygote.fingerprint({**env, "TORCH_LOGS": "recompiles"}) != zygote.fingerprint(env)
    assert zygote.fingerprint({**env, "PYTHONPATH": "/elsewhere"}) != zygote.fingerprint(env)
