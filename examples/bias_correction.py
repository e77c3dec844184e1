"""Bias correction on the demo's digits CNN: accuracy and SQNR before and after.

Trains the demo's SmallCNN (examples/demo.py), quantizes it post-training with the fbgemm
(per-channel int8 weights) and qnnpack (per-tensor weights) qconfig mappings, then applies
``quantbridge.fx_quant.bias_correction`` to the reference model with the calibration batches.
Prints test accuracy and the SQNR of the logits against the float model, before and after,
and the accuracy of the numba-lowered corrected model.

Run: ``python examples/bias_correction.py`` (about half a minute).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import BATCH, SmallCNN, accuracy, batches, load_data, train

from quantbridge.fx_quant import (
    bias_correction,
    calibrate,
    convert_to_reference_fx,
    prepare_fx,
)
from quantbridge.lowering import get_backend
from quantbridge.qconfig import get_default_qconfig_mapping


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).pow(2).sum()
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(b) for b in batches(x, BATCH)])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--calib-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed)
    model = SmallCNN()
    train(model, x_train, y_train, args.epochs, 3e-3, "train fp32")
    print()
    float_logits = logits(model, x_test)
    print(f"fp32: accuracy {accuracy(model, x_test, y_test):.2f}%")
    calib = list(batches(x_train, BATCH))[: args.calib_batches]
    for mapping_name in ("fbgemm", "qnnpack"):
        prepared = prepare_fx(
            copy.deepcopy(model).eval(),
            get_default_qconfig_mapping(mapping_name),
            (x_train[:BATCH],),
        )
        calibrate(prepared, calib, progress=False)
        ref = convert_to_reference_fx(prepared)
        before_acc = accuracy(ref, x_test, y_test)
        before_sqnr = sqnr_db(float_logits, logits(ref, x_test))
        bias_correction(ref, calib)
        after_acc = accuracy(ref, x_test, y_test)
        after_sqnr = sqnr_db(float_logits, logits(ref, x_test))
        lowered = get_backend("numba").lower(copy.deepcopy(ref))
        print(
            f"{mapping_name:<8} reference: accuracy {before_acc:.2f}% -> {after_acc:.2f}%, "
            f"logit SQNR {before_sqnr:.2f} dB -> {after_sqnr:.2f} dB; "
            f"numba-lowered corrected: {accuracy(lowered, x_test, y_test):.2f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
