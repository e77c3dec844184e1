"""Byte identity of the model zoo's outputs, per backend: the harness for refactors that must
not change a single output byte.

    python targets/zoo_hashes.py --out before.json      # on the commit before the change
    python targets/zoo_hashes.py --compare before.json  # after it: exit 1 on any difference

Every model of ``tests/quantized_zoo.py`` (CNNs, BERT with outliers, ViT, the lowering zoo's
cases) is built once, lowered by every backend this CPU runs (``reference`` and each
``numba_<target>``), and run on its inputs and on the same inputs laced with NaN and
infinities; each output's bytes (dtype, shape and data) go into a SHA-256 per model and
backend. One thread for torch and the kernels, so float reductions add in one order.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]
import quantized_zoo  # noqa: E402
from zoo_outputs import _laced  # noqa: E402

import quantbridge.kernels as qk  # noqa: E402
from quantbridge.lowering import BackendUnavailableError, get_backend  # noqa: E402

BACKENDS = ("reference", "numba_generic", "numba_avx2", "numba_avx_vnni", "numba_avx512_vnni")


def _feed(digest: Any, value: Any) -> None:
    """Every tensor in ``value`` (nested tuples, lists, dicts) into ``digest``, in order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (tuple, list)):
        for v in value:
            _feed(digest, v)
    elif isinstance(value, dict):
        for k in sorted(value):
            digest.update(str(k).encode())
            _feed(digest, value[k])
    elif hasattr(value, "to_tuple"):  # transformers-style model outputs
        _feed(digest, value.to_tuple())
    else:
        digest.update(repr(value).encode())


def hashes() -> dict[str, dict[str, str]]:
    """``{backend: {model: sha256}}`` for every backend this CPU runs."""
    backends = {}
    for name in BACKENDS:
        try:
            backends[name] = get_backend(name)
        except BackendUnavailableError as e:
            print(f"{name}: not run here ({e})", file=sys.stderr)
    result: dict[str, dict[str, str]] = {name: {} for name in backends}
    for model in quantized_zoo.zoo_models():
        reference, inputs = model.build()
        laced = tuple(_laced(x) if x.is_floating_point() else x for x in inputs)
        for name, backend in backends.items():
            lowered = backend.lower(copy.deepcopy(reference))
            digest = hashlib.sha256()
            with torch.no_grad():
                _feed(digest, lowered(*inputs))
                if model.static:
                    _feed(digest, lowered(*laced))
            result[name][model.name] = digest.hexdigest()
        print(f"{model.name}: done", file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the hashes to this JSON file")
    group.add_argument("--compare", type=Path, help="compare with a file --out wrote")
    args = parser.parse_args()
    torch.set_num_threads(1)
    qk.set_num_threads(1)
    current = hashes()
    numba = [name for name in current if name.startswith("numba")]
    agree = sum(len({current[b][m] for b in numba}) == 1 for m in current[numba[0]])
    print(
        f"the numba targets run here ({', '.join(numba)}) agree on {agree} of "
        f"{len(current[numba[0]])} models"
    )
    if args.out:
        args.out.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
        print(f"{sum(len(v) for v in current.values())} hashes written to {args.out}")
        return 0
    before = json.loads(args.compare.read_text())
    differ = [
        f"{backend} / {model}"
        for backend, models in current.items()
        for model, digest in models.items()
        if backend in before and before[backend].get(model, digest) != digest
    ]
    missing = [
        f"{backend} / {model}"
        for backend, models in before.items()
        if backend in current
        for model in models
        if model not in current[backend]
    ]
    compared = sum(len(v) for k, v in current.items() if k in before)
    print(f"{compared} outputs compared with {args.compare}")
    for line in differ:
        print(f"  differs: {line}")
    for line in missing:
        print(f"  missing now: {line}")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
