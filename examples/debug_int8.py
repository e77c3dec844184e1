"""Debugging a bad int8 model: find the layer that broke, then fix it by hand or automatically.

1. Train the demo's small CNN on scikit-learn's digits (see ``demo.py``), then make ``conv1``
   sensitive without changing what the float model computes: its output channel 0 is scaled
   by 300 and ``conv2``'s weights reading that channel by 1/300 (ReLU commutes with a
   positive scale). One per-tensor activation scale now has to cover a channel 300x larger
   than the others, which get only a few int8 levels.
2. Plain PTQ with the ``numba`` backend: accuracy drops.
3. ``compare_layers`` names the layers that lose the signal (SQNR per op, isolated and
   propagated), ``compare_weights`` shows the weights are not the problem.
4. The fix by hand: ``QConfigMapping.set_module_name(name, None)`` for those layers.
5. ``auto_quantize`` finds the same fix from an accuracy budget.

Lines starting with ``RESULT`` are checked by the project's tests.
Run: ``python examples/debug_int8.py`` (about 15 s).
"""

from __future__ import annotations

import copy
import os

import torch
from demo import SmallCNN, accuracy, load_data, train

from quantbridge.fx_quant import calibrate, compare_layers, compare_weights, prepare_fx
from quantbridge.lowering import (
    AutoQuantizeReport,
    auto_quantize,
    get_backend,
    lowering_report,
)

os.environ.setdefault("QUANTBRIDGE_NO_PROGRESS", "1")  # keep the printed output short
SCALE = 300.0
MAX_DROP = 1.0  # percentage points of test accuracy


def make_sensitive(model: SmallCNN) -> None:
    """Scale conv1's output channel 0 by SCALE and undo it in conv2: same float function."""
    with torch.no_grad():
        model.conv1.weight[0] *= SCALE
        model.conv1.bias[0] *= SCALE
        model.conv2.weight[:, 0] /= SCALE


def main() -> None:
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_data(0)
    model = SmallCNN()
    train(model, x_train, y_train, 4, 3e-3, "train fp32")
    make_sensitive(model)
    calibration = [(x_train[i : i + 64],) for i in range(0, 640, 64)]

    def eval_fn(m: torch.nn.Module) -> float:
        return float(accuracy(m, x_test, y_test))

    backend = get_backend("numba")
    float_acc = eval_fn(model)
    print(f"RESULT float accuracy {float_acc:.2f}")

    # plain PTQ
    prepared = prepare_fx(
        copy.deepcopy(model),
        backend.qconfig_mapping(),
        calibration[0],
        backend_config=backend.backend_config,
    )
    calibrate(prepared, calibration)
    int8 = backend.convert(prepared)
    print(f"RESULT int8 accuracy {eval_fn(int8):.2f}")

    # which layer broke?
    report = compare_layers(model, int8, calibration[:4])
    print(report)
    print(compare_weights(model, int8))
    worst = report.worst(2, view="isolated")
    print("RESULT worst isolated", [r.name for r in worst])
    print("RESULT worst propagated", report.worst(1, view="propagated")[0].name)

    # the fix by hand: leave the sensitive conv and the conv after it in float
    mapping = backend.qconfig_mapping()
    mapping.set_module_name("conv1", None).set_module_name("conv2", None)
    prepared = prepare_fx(
        copy.deepcopy(model), mapping, calibration[0], backend_config=backend.backend_config
    )
    calibrate(prepared, calibration)
    fixed = backend.convert(prepared)
    print(f"RESULT by hand accuracy {eval_fn(fixed):.2f}")

    # the same, automatically
    auto = auto_quantize(model, backend, calibration, eval_fn=eval_fn, max_drop=MAX_DROP)
    auto_report = lowering_report(auto)
    assert isinstance(auto_report, AutoQuantizeReport)  # what auto_quantize's search records
    print(auto_report)
    print(f"RESULT auto accuracy {eval_fn(auto):.2f}")
    print("RESULT auto float layers", auto_report.float_layers)


if __name__ == "__main__":
    main()
