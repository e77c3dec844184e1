"""quantbridge's main job, as far as the packages built so far reach.

1. Train a small MLP on scikit-learn's digits data (shipped with scikit-learn; no download).
2. Calibrate quantbridge observers on the training data: a HistogramObserver on every layer's
   input activation and a per-channel symmetric int8 observer on every weight.
3. Print the qparams table; while torch still ships torch.ao, each row is checked bit for bit
   against torch.ao's observer fed the same data.
4. Apply those qparams (fake quantization on plain float tensors) and report test accuracy
   against the float model.

Run with ``nox -s demo`` (or ``python examples/demo.py`` where the packages are installed).
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from quantbridge.qconfig import HistogramObserver, PerChannelMinMaxObserver


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_train, x_test, y_train, y_test


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(0)
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(x), generator=generator)
        total = 0.0
        for start in range(0, len(x), 64):
            idx = order[start : start + 64]
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(idx)
        if epoch % 10 == 0 or epoch == epochs:
            print(f"  epoch {epoch:3d}/{epochs}  loss {total / len(x):.4f}", flush=True)


def accuracy(
    model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean()) * 100.0


def torch_ao_observers() -> tuple[type, type] | None:
    """torch.ao's HistogramObserver and PerChannelMinMaxObserver, while torch ships them."""
    try:
        observer = importlib.import_module("torch.ao.quantization.observer")
    except ImportError:
        return None
    return observer.HistogramObserver, observer.PerChannelMinMaxObserver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    x_train, x_test, y_train, y_test = load_data(args.seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    print(f"digits: {len(x_train)} training and {len(x_test)} test images of 8x8 pixels")
    print("training the float model")
    started = time.perf_counter()
    train(model, x_train, y_train, args.epochs)
    model.eval()
    print(f"  trained in {time.perf_counter() - started:.1f} s")

    linears = [(f"{i}", m) for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    act_observers = {name: HistogramObserver() for name, _ in linears}
    weight_observers = {
        name: PerChannelMinMaxObserver(dtype=torch.int8, qscheme="per_channel_symmetric")
        for name, _ in linears
    }
    oracle = torch_ao_observers()
    oracle_act = {name: oracle[0]() for name, _ in linears} if oracle else {}

    # Calibrate: every layer's input activation, batch by batch, like prepare_fx's observers.
    print("calibrating observers on the training data")
    hooks = []
    for name, layer in linears:

        def observe(_module: nn.Module, inputs: tuple[torch.Tensor, ...], name: str = name) -> None:
            act_observers[name](inputs[0])
            if name in oracle_act:
                oracle_act[name](inputs[0])

        hooks.append(layer.register_forward_pre_hook(observe))
    with torch.no_grad():
        for start in range(0, len(x_train), 128):
            model(x_train[start : start + 128])
    for hook in hooks:
        hook.remove()
    for name, layer in linears:
        weight_observers[name](layer.weight.detach())

    print()
    header = (
        f"{'tensor':<12}{'observer':<28}{'min':>10}{'max':>10}{'scale':>22}{'zero_point':>12}"
        "  torch.ao"
    )
    print(header)
    print("-" * len(header))
    mismatches = 0
    qparams: dict[
        str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ] = {}
    for name, layer in linears:
        act_scale, act_zp = act_observers[name].calculate_qparams()
        w_scale, w_zp = weight_observers[name].calculate_qparams()
        qparams[name] = ((act_scale, act_zp), (w_scale, w_zp))
        verdict = "n/a (torch.ao gone)"
        if oracle:
            ref_scale, ref_zp = oracle_act[name].calculate_qparams()
            same = torch.equal(ref_scale, act_scale) and torch.equal(ref_zp, act_zp)
            mismatches += not same
            verdict = "bit-identical" if same else "DIFFERS"
        obs = act_observers[name]
        print(
            f"{name + '.input':<12}{'HistogramObserver(uint8)':<28}{float(obs.min_val):>10.4f}"
            f"{float(obs.max_val):>10.4f}{float(act_scale):>22.6g}{int(act_zp):>12}  {verdict}"
        )
        verdict = "n/a (torch.ao gone)"
        if oracle:
            ref = oracle[1](dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            ref(layer.weight.detach())
            ref_scale, ref_zp = ref.calculate_qparams()
            same = torch.equal(ref_scale, w_scale) and torch.equal(ref_zp, w_zp)
            mismatches += not same
            verdict = "bit-identical" if same else "DIFFERS"
        w_obs = weight_observers[name]
        print(
            f"{name + '.weight':<12}{'PerChannelMinMax(int8,sym)':<28}"
            f"{float(w_obs.min_val.min()):>10.4f}{float(w_obs.max_val.max()):>10.4f}"
            f"{f'{float(w_scale.min()):.3g} .. {float(w_scale.max()):.3g}':>22}"
            f"{f'{int(w_zp.min())} .. {int(w_zp.max())}':>12}  {verdict}"
        )

    def quantized_forward(x: torch.Tensor) -> torch.Tensor:
        # Fake quantization on plain float tensors: what an int8 backend computes, up to the
        # rounding of its accumulator requantization.
        for i, module in enumerate(model):
            name = str(i)
            if name in qparams:
                (a_scale, a_zp), (w_scale, w_zp) = qparams[name]
                x = torch.fake_quantize_per_tensor_affine(x, float(a_scale), int(a_zp), 0, 255)
                weight = torch.fake_quantize_per_channel_affine(
                    module.weight, w_scale, w_zp.to(torch.int32), 0, -128, 127
                )
                x = nn.functional.linear(x, weight, module.bias)
            else:
                x = module(x)
        return x

    float_acc = accuracy(model, x_test, y_test)
    quant_acc = accuracy(quantized_forward, x_test, y_test)
    print()
    print(f"{'model':<34}{'test accuracy':>14}")
    print(f"{'float32':<34}{float_acc:>13.2f}%")
    print(f"{'int8 weights + uint8 activations':<34}{quant_acc:>13.2f}%")
    print(f"accuracy change: {quant_acc - float_acc:+.2f} percentage points")
    if mismatches:
        raise SystemExit(f"{mismatches} qparams differ from torch.ao's observers")


if __name__ == "__main__":
    main()
