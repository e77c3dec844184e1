"""The examples run as users run them (a fresh interpreter) and show what they promise."""

from __future__ import annotations

import ast
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


def test_debug_int8() -> None:
    result = _run("debug_int8.py")
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = {}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            key, _, value = line.removeprefix("RESULT ").partition(" [")
            if value:
                found[key] = ast.literal_eval("[" + value)
            else:
                key, _, number = line.removeprefix("RESULT ").rpartition(" ")
                found[key] = number
    float_acc = float(str(found["float accuracy"]))
    # the sensitive conv1 costs int8 more than the 1-point budget; both fixes are within it
    assert float(str(found["int8 accuracy"])) < float_acc - 1.0
    assert float(str(found["by hand accuracy"])) >= float_acc - 1.0
    assert float(str(found["auto accuracy"])) >= float_acc - 1.0
    # compare_layers names conv1 (the x300 channel) or conv2 (reads it) first, in both views
    worst, auto_float = found["worst isolated"], found["auto float layers"]
    assert isinstance(worst, list)
    assert isinstance(auto_float, list)
    assert worst[0] in ("conv1", "conv2")
    assert found["worst propagated"] in ("conv1", "conv2")
    assert sorted(auto_float) == ["conv1", "conv2"]
    assert "left float by auto_quantize: " in result.stdout
    assert "Traceback" not in result.stderr
