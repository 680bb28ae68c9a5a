"""The torchvision schema hook (gaudi_testkit.torchvision_schemas): torchvision's Python
parts import where its compiled library does not load, and nothing changes where it does.

A stand-in torchvision package in a temporary folder behaves as the real one does on import: it
tries to load its `_C` library (here a file that is not a library), then registers a fake kernel
for `torchvision::nms`, which fails unless something defined the operator.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

STANDIN_INIT = textwrap.dedent(
    """
    import torch
    try:
        torch.ops.load_library(__path__[0] + "/_C.so")
        HAS_OPS = True
    except OSError:
        HAS_OPS = False

    @torch.library.register_fake("torchvision::nms")
    def meta_nms(dets, scores, iou_threshold):
        return dets.new_empty(0, dtype=torch.long)
    """
)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from gaudi_testkit import torchvision_schemas
    torchvision_schemas.uninstall()  # the .pth's hook: each case installs it or not itself
    if os.environ["PROBE_MODE"] == "hooked":
        torchvision_schemas.install()
    try:
        import torchvision
    except Exception as exc:
        print(json.dumps({"imported": False, "error": str(exc)}))
        raise SystemExit(0)
    try:
        torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
        call = "ran"
    except NotImplementedError as exc:
        call = "NotImplementedError"
    print(json.dumps({
        "imported": True,
        "has_ops": torchvision.HAS_OPS,
        "outcome": torchvision_schemas.state["outcome"],
        "call": call,
        "hooks_left": sum(type(f).__name__ == "_TorchvisionHook" for f in sys.meta_path),
    }))
    """
)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tv")
    package = root / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(STANDIN_INIT)
    (package / "_C.so").write_bytes(b"not a shared library")
    return root


def _probe(run_python, standin: Path, mode: str) -> dict:
    import json

    proc = run_python(PROBE, {"PYTHONPATH": str(standin), "PROBE_MODE": mode})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_without_the_hook_torchvision_does_not_import(run_python, standin):
    result = _probe(run_python, standin, "bare")
    assert result["imported"] is False
    assert "torchvision::nms" in result["error"]


@pytest.mark.process
def test_the_hook_defines_the_schemas_so_torchvision_imports(run_python, standin):
    result = _probe(run_python, standin, "hooked")
    assert result["imported"] is True and result["has_ops"] is False
    assert "_C.so" in result["outcome"]  # the load error it worked around, for doctor
    assert result["call"] == "NotImplementedError"  # the compiled op stays unavailable
    assert result["hooks_left"] == 0  # one shot


@pytest.mark.process
def test_the_installed_environment_imports_torchvision(run_python):
    """The set-up installs torchvision and the platform wheel's .pth installs the hook."""
    proc = run_python(
        "import torchvision, transformers\n"
        "from transformers import Qwen2VLImageProcessor\n"
        "print(torchvision.__version__)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
