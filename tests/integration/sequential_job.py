"""Runs several offline generation jobs one after another in ONE fresh process, so vLLM is
imported and its platform resolved once for all of them:

    python sequential_job.py '{"<name>": <engine_job.py job>, ...}'

Each job is what `engine_job.py` takes, plus an optional "env" (variables set while that job
runs, e.g. bucketing settings its engine reads at start); its LLM is deleted before the next
starts. Prints one `RESULT <name> <json>` line per job; a job that fails prints
`{"error": ...}` instead, so the others still report.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback

from engine_job import environment, run  # this script's folder is first on sys.path


def main(jobs: dict[str, dict]) -> None:
    for name, job in jobs.items():
        try:
            with environment(job.pop("env", {})):
                result = run(job)
        except Exception as exc:  # report, and let the next job run
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()  # the finished job's engine shuts down before the next one starts
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
