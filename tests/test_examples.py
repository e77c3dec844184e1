"""The examples run as users run them (a fresh interpreter) and show what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_backend_config_tutorial() -> None:
    result = _run("backend_config_tutorial.py")
    assert result.returncode == 0, result.stderr
    results = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    # the tutorial's three outcomes: linear and the fused conv-relu quantized (sigmoid float);
    # conv-bn-relu neither fused nor quantized; the default mapping quantizes nothing
    assert results == [
        "RESULT conv-relu: quantized=['linear', 'conv'] float=['sigmoid']",
        "RESULT conv-bn-relu: quantized=['linear'] float=['conv', 'bn', 'relu', 'sigmoid']",
        "RESULT default-mapping: quantized=[] float=['linear', 'conv', 'bn', 'relu', 'sigmoid']",
    ]
    first = result.stdout.split("== conv-bn-relu")[0]
    assert "(sigmoid): Sigmoid()" in first
    assert "(conv): Conv2d" not in first  # fused and quantized
    # the default mapping's qconfig is ignored with a warning, as in torch.ao
    assert "ignored the qconfig of 1 node(s)" in result.stderr
    assert "activation eps 1.19e-07 below backend scale_min 2**-12" in result.stderr
    assert "Traceback" not in result.stderr
