"""The model zoo's lowered outputs at one level: ``python zoo_outputs.py OUT.npz``.

Run by the target matrix once per level, with numba compiling for that level. Every model is
quantized with the same qconfigs at every level (fixed activation and weight bits, not the
target's defaults), so the reference models are identical and the lowered outputs must be the
same bytes. Inputs: ordinary ones and NaN / +-inf laced ones. Each lowered output is saved
with its reference model's output and the bound their difference must keep. A line naming
each model goes to stdout before it runs: after a crash, the last one names the culprit.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "packages" / "lowering" / "tests")]

import lowering_zoo  # noqa: E402
import real_models  # noqa: E402
from quantized_zoo import BACKEND, bert_reference, case_reference, cnn_reference  # noqa: E402
from test_lowering_numerics import _coarsest_step  # noqa: E402

import quantbridge.kernels as qk  # noqa: E402


def _laced(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +inf and -inf every few elements."""
    x = x.clone()
    flat = x.view(-1)
    flat[::37], flat[5::41], flat[11::43] = float("nan"), float("inf"), -float("inf")
    return x


def _first(result: Any) -> Any:
    return result[0] if isinstance(result, tuple) else result


def _save(out: dict[str, Any], key: str, lowered: Any, reference: Any, bound: float) -> None:
    out[f"{key}/lowered"] = torch.as_tensor(lowered).numpy()
    out[f"{key}/reference"] = torch.as_tensor(reference).numpy()
    out[f"{key}/bound"] = np.float64(bound)


def cnns(out: dict[str, Any]) -> None:
    for name in real_models.MODELS:
        for bits in (7, 8):
            print(f"cnn {name}, {bits}-bit activations", flush=True)
            reference = cnn_reference(name, activation_bits=bits)
            lowered = BACKEND.lower(copy.deepcopy(reference))
            bound = _coarsest_step(reference)
            x = real_models.example_input(9)
            with torch.no_grad():
                for kind, inp in (("clean", x), ("laced", _laced(x))):
                    _save(out, f"{name}/a{bits}/{kind}", lowered(inp), reference(inp), bound)


def small_cases(out: dict[str, Any]) -> None:
    for case in lowering_zoo.ALL_CASES:
        print(f"case {case.name}", flush=True)
        reference, inputs = case_reference(case)
        lowered = BACKEND.lower(copy.deepcopy(reference))
        # static cases: within the coarsest step; dynamic ones requantize at run time
        bound = _coarsest_step(reference) if case.mode == "static" else 0.05
        with torch.no_grad():
            got, want = lowered(*inputs), reference(*inputs)
            _save(out, f"{case.name}/clean", _first(got), _first(want), bound)
            if case.mode == "static":
                laced = tuple(_laced(x) if x.is_floating_point() else x for x in inputs)
                _save(out, f"{case.name}/laced", _first(lowered(*laced)),
                      _first(reference(*laced)), bound)  # fmt: skip


def bert(out: dict[str, Any]) -> None:
    print("bert static, transformer mapping, outlier channels", flush=True)
    reference, (ids, mask) = bert_reference()
    lowered = BACKEND.lower(copy.deepcopy(reference))
    with torch.no_grad():
        want = reference(ids, mask)
        # float ops (LayerNorm, softmax, GELU) round differently from torch's: bounded by
        # a fraction of the pooled output's spread
        _save(out, "bert/clean", lowered(ids, mask), want, 0.05 * float(want.abs().max()))


def main(path: str) -> None:
    print(f"kernel target {qk.best_target()}", flush=True)
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    small_cases(out)
    bert(out)
    cnns(out)
    np.savez(path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
