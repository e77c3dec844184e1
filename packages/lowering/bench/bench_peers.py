"""quantbridge beside its peers: torch.ao, ONNX Runtime and OpenVINO/NNCF int8, side by side.

Run by ``nox -s bench_peers`` (the only session that installs onnxruntime, openvino, nncf,
transformers and onnx, pinned in constraints.txt):

    python packages/lowering/bench/bench_peers.py [--models resnet18 mobilenet_v2 bert lstm]
        (also resnet50, mobilenet_v3_small, efficientnet_b0, vit_b_16 when named)
        [--threads 1 2] [--rounds 20] [--sentences 256] [--json OUT] [--profile]

Models and columns:

* ``resnet18`` / ``mobilenet_v2`` (batch 1, 3x224x224): torchvision's architectures from
  ``tests/real_models.py`` with seeded weights and settled BN statistics. fp32 eager (NCHW and
  channels-last, both timed; the faster is the fp32 figure), torch.ao x86 ``convert_fx``,
  quantbridge ``get_backend("numba")``, ONNX Runtime ``quantize_static`` (QDQ, per-channel
  int8 weights, uint8 activations, on ``torch.onnx.export``'s model) and OpenVINO int8
  (``nncf.quantize`` on ``openvino.convert_model``'s model). Every int8 column is calibrated
  on the same batches; SQNR (dB) of its logits against fp32 on held-out inputs.
* ``vit_b_16`` (batch 1, 3x224x224): torchvision's ViT-B/16 from ``tests/vit_model.py``,
  seeded weights, the same columns; quantbridge with ``qconfig_mapping(transformer=True)``,
  OpenVINO with NNCF's ``ModelType.TRANSFORMER``. ``--trained-outliers`` gives it the
  activation statistics of a trained ViT first (``vit_model.add_trained_statistics``) and adds
  the column "the recipe" (``keep_outlier_channels_float`` before the transformer mapping).
* ``bert``: transformers ``BertModel`` (6 layers, hidden 384, 12 heads, FFN 1536, random
  init: nothing is downloaded), random sentences padded to 128 tokens with an attention mask,
  batch 1 and 16. fp32 eager, torch.ao ``quantize_dynamic``, ONNX Runtime
  ``quantize_dynamic``, OpenVINO int8 (``nncf.quantize``, ``ModelType.TRANSFORMER``),
  quantbridge dynamic (per tensor and per token) and static (the model captured unmodified
  with ``prepare_fx(..., capture="export")``; dynamic with ``qconfig_mapping(dynamic=True)``,
  static with ``qconfig_mapping(transformer=True)``: the backend's default bits, on ``avx2``
  8-bit weights and 7-bit activations; "static recipe" after
  ``keep_outlier_channels_float``). ``--trained-outliers`` gives the encoder the activation
  statistics of a trained BERT first (``bert_zoo.add_trained_outliers``). Fidelity on
  ``--sentences`` random sentences: mean cosine of the mean-pooled embeddings against fp32,
  the mean overlap of each sentence's 10 nearest neighbours (cosine) with fp32's, and the
  SQNR of the pooled embeddings.
* ``lstm``: ``nn.LSTM`` 2 layers, input and hidden 512, sequence 64, batch 8: fp32, torch.ao
  dynamic LSTM, quantbridge dynamic (the LSTM's qconfig from ``qconfig_mapping(dynamic=True)``;
  the output says whether its LSTM is still float).

Timing: every column runs one forward per round, columns interleaved within each round (load
from other processes hits all alike), median (and minimum) ms over ``--rounds``. Threads per
``--threads`` count: ``torch.set_num_threads`` (fp32, torch.ao, and the quantbridge kernels,
which follow torch's setting), ONNX Runtime ``intra_op_num_threads`` (one session per count;
spin-waiting off, so an idle session does not steal the core of the next column) and OpenVINO
``INFERENCE_NUM_THREADS`` (one compiled model per count, latency hint, one stream). A peer
that fails prints its error in its cell and the run goes on.

``--profile``: after a model's timings, where a second kind of row is wanted (why is one
column slower?), each quantbridge model and OpenVINO's run again, interleaved round by
round, with timers on the parts: quantbridge's kernel modules by kind (a conv also by its
kernel size, or depthwise) and the time between them (torch ops, argument handling);
OpenVINO's per-layer counters (``PERF_COUNT``) by layer kind and kernel. Medians in µs per
forward; the timers cost a little, so these runs are not the timings above.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import functools
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ``--isa avx2`` caps every runtime at AVX2 + FMA, as on a CPU without AVX-512 (``--isa avx_vnni``:
# with AVX-VNNI too, as on Intel's Alder Lake and later client cores), through the
# variables each one reads when it loads, so they are set before any is imported: numba's
# CPU (quantbridge's kernel target follows it), oneDNN's (OpenVINO's and torch's), fbgemm's
# (torch.ao x86) and ATen's. ONNX Runtime's MLAS has no such setting: its column keeps the
# host's instructions.
ISA_CAPS = {
    "avx2": {
        "NUMBA_CPU_NAME": "x86-64-v3",
        "NUMBA_CPU_FEATURES": "",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    "avx_vnni": {
        "NUMBA_CPU_NAME": "x86-64-v3",
        "NUMBA_CPU_FEATURES": "+avxvnni",
        "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "DNNL_MAX_CPU_ISA": "AVX2_VNNI",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # fbgemm has no AVX-VNNI kernels
        "ATEN_CPU_CAPABILITY": "avx2",
    },
}
if "--isa" in sys.argv[:-1]:
    os.environ.update(ISA_CAPS.get(sys.argv[sys.argv.index("--isa") + 1], {}))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.fx import GraphModule  # noqa: E402

import quantbridge.kernels as qk  # noqa: E402
from quantbridge.fx_quant import (  # noqa: E402
    calibrate,
    keep_outlier_channels_float,
    prepare_fx,
)
from quantbridge.lowering import LoweredModule, get_backend, numba_backend  # noqa: E402
from quantbridge.qconfig import QConfigMapping  # noqa: E402

# The peers' quantization recipes are shared with the asv suite (importable there).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "asv_bench" / "benchmarks"))
import _peers  # noqa: E402

# torchvision-style networks (torchvision itself does not import under the pinned torch)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import real_models  # noqa: E402
from vit_model import VisionTransformer, add_trained_statistics  # noqa: E402

# the trained-like encoder statistics of the lowering tests' BERT zoo
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bert_zoo import add_trained_outliers, hf_bert_parts  # noqa: E402

MODELS = ("resnet18", "mobilenet_v2", "bert", "lstm")
# more torchvision-style networks, run only when named in --models
OTHER_CNNS = ("resnet50", "mobilenet_v3_small", "efficientnet_b0", "vit_b_16")
# image models quantized as transformers (the transformer mapping; OpenVINO's transformer
# preset): torchvision's ViT-B/16 as written in tests/vit_model.py, seeded weights
VISION_TRANSFORMERS = ("vit_b_16",)
Runner = Callable[[], np.ndarray]  # as in _peers: one call on the bound input
# A column builds one runner per thread count (ORT sessions and OpenVINO compiled models fix
# their thread count at creation; torch-based columns ignore it: set_num_threads rules them).
Column = Callable[[int], Runner]

# exported and quantized ONNX files (a few hundred MB for BERT), removed at exit
WORK = Path(tempfile.mkdtemp(prefix="qb-bench-peers-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


class NotAvailableError(Exception):
    """A column that cannot exist here; its message is the whole cell (no traceback)."""


def short_error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    first = lines[0][:160] if lines else ""
    return first if isinstance(e, NotAvailableError) else f"{type(e).__name__}: {first}"


def sqnr(reference: np.ndarray, other: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``other`` against ``reference``, in dB."""
    noise = float(np.sum((reference.astype(np.float64) - other) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def ort_column(path: Path, feeds: dict[str, np.ndarray]) -> Column:
    return lambda threads: _peers.ort_runner(path, feeds, threads)


def openvino_column(ov_model: Any, feeds: dict[str, np.ndarray]) -> Column:
    return lambda threads: _peers.openvino_runner(ov_model, feeds, threads)


def torch_column(model: Callable[..., Any], *args: Any) -> Column:
    return lambda threads: lambda: _peers.to_numpy(model(*args))


def prepare_calibrated(
    model: nn.Module,
    mapping: QConfigMapping,
    example: tuple[Any, ...],
    calib: list[tuple[Any, ...]],
    **prepare_args: Any,
) -> GraphModule:
    """prepare (a copy of ``model``) with the numba backend's config, calibrate on ``calib``."""
    prepared = prepare_fx(
        copy.deepcopy(model),
        mapping,
        example,
        backend_config=get_backend("numba").backend_config,
        **prepare_args,
    )
    calibrate(prepared, calib, progress=False)
    return prepared


def _quantbridge(
    model: nn.Module,
    mapping: QConfigMapping,
    example: tuple[Any, ...],
    calib: list[tuple[Any, ...]],
    **prepare_args: Any,
) -> nn.Module:
    """prepare with the numba backend's config, calibrate, convert + lower by ``numba``."""
    prepared = prepare_calibrated(model, mapping, example, calib, **prepare_args)
    lowered: nn.Module = get_backend("numba").convert(prepared)
    return lowered


# --- the models -------------------------------------------------------------------------------


@dataclass
class Suite:
    """Columns of one model at one input size, and what to print about fidelity."""

    name: str
    columns: dict[str, Column] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # column -> fidelity figures (SQNR dB, cosine, top-10 overlap)
    fidelity: dict[str, dict[str, float]] = field(default_factory=dict)
    # fp32 columns of which only the fastest counts as "fp32"
    fp32_variants: tuple[str, ...] = ("fp32",)
    # column -> per-part timer (``--profile``): given the thread count, a call that runs one
    # forward and returns µs per part (and "total")
    profiles: dict[str, Callable[[int], Callable[[], dict[str, float]]]] = field(
        default_factory=dict
    )

    def add(self, name: str, build: Callable[[], Column]) -> Column | None:
        print(f"  building {self.name}: {name}", flush=True)
        try:
            column = build()
        except Exception as e:  # a peer that fails is a result, not the end of the run
            self.errors[name] = short_error(e)
            if not isinstance(e, NotAvailableError):
                traceback.print_exc(limit=4, file=sys.stderr)
            return None
        self.columns[name] = column
        return column


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def calib_images(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 3, 224, 224, generator=g) for _ in range(n)]


def cnn_suite(
    name: str, calib_batches: int, eval_batches: int, trained_outliers: bool = False
) -> Suite:
    transformer = name in VISION_TRANSFORMERS
    trained = transformer and trained_outliers
    suite = Suite(
        f"{name} (trained-like)" if trained else name,
        fp32_variants=("fp32 NCHW", "fp32 channels_last"),
    )
    if transformer:
        torch.manual_seed(0)
        model = VisionTransformer().eval()
        if trained:  # the activation statistics of a trained ViT (vit_model)
            add_trained_statistics(model)
    else:
        model = real_models.build(name, full_size=True).eval()
    calib = calib_images(calib_batches, seed=1)
    held_out = calib_images(eval_batches, seed=2)
    x = held_out[0].clone()  # every column reads this input; refilled in place for SQNR
    feeds = {"input": x.numpy()}  # shares x's memory
    with torch.no_grad():
        reference = [model(h).numpy() for h in held_out]
        channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x_cl = x.contiguous(memory_format=torch.channels_last)

    suite.add("fp32 NCHW", lambda: torch_column(model, x))
    suite.add("fp32 channels_last", lambda: torch_column(channels_last, x_cl))

    def torch_ao() -> Column:
        ao = _peers.torch_ao_x86(model, "static", (x,), [(c,) for c in calib])
        return torch_column(ao, x)

    suite.add("torch.ao x86", torch_ao)

    def numba() -> Column:
        backend = get_backend("numba")
        target = getattr(backend, "target", "?")
        suite.notes.append(f"quantbridge numba: get_backend('numba'), kernel target {target}")
        mapping = backend.qconfig_mapping(transformer=transformer)
        lowered = _quantbridge(model, mapping, (x,), [(c,) for c in calib])
        suite.profiles["quantbridge numba"] = _module_times(lowered, x)
        return torch_column(lowered, x)

    suite.add("quantbridge numba", numba)

    def recipe() -> Column:
        split = keep_outlier_channels_float(model, [(c,) for c in calib])
        mapping = get_backend("numba").qconfig_mapping(transformer=True)
        return torch_column(_quantbridge(split, mapping, (x,), [(c,) for c in calib]), x)

    if trained:
        suite.add("quantbridge numba, recipe", recipe)

    def ort() -> Column:
        fp32 = _peers.onnx_export(model, (x,), ["input"], WORK / f"{name}.onnx")
        calib_feeds = [{"input": c.numpy()} for c in calib]
        int8 = _peers.ort_quantize_static(fp32, calib_feeds, WORK / f"{name}.qdq.onnx")
        return ort_column(int8, feeds)

    suite.add("ORT int8 QDQ", ort)

    def openvino() -> Column:
        quantized = _peers.openvino_int8(
            model, x, [c.numpy() for c in calib], transformer=transformer
        )
        suite.profiles["OpenVINO int8"] = functools.partial(
            _peers.openvino_layer_times, quantized, feeds
        )
        return openvino_column(quantized, feeds)

    suite.add("OpenVINO int8", openvino)

    # SQNR of every int8 column on the held-out images (one thread)
    with torch.no_grad(), torch_threads(1):
        for column, make in list(suite.columns.items()):
            if column in suite.fp32_variants:
                continue
            try:
                outs = []
                runner = make(1)
                for h in held_out:
                    x.copy_(h)
                    outs.append(runner())
                suite.fidelity[column] = {
                    "sqnr_db": sqnr(np.concatenate(reference), np.concatenate(outs))
                }
            except Exception as e:
                suite.errors[column] = short_error(e)
                del suite.columns[column]
        x.copy_(held_out[0])
    return suite


# BERT ------------------------------------------------------------------------------------------

BERT_SEQ = 128


def random_sentences(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random "sentences": [CLS] tokens [SEP], 8..128 long, zero-padded to 128."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(n, BERT_SEQ, dtype=torch.long)
    mask = torch.zeros(n, BERT_SEQ, dtype=torch.long)
    lengths = torch.randint(8, BERT_SEQ + 1, (n,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        ids[i, 0], ids[i, length - 1] = 101, 102  # [CLS], [SEP] in BERT's vocabulary
        ids[i, 1 : length - 1] = torch.randint(1000, vocab, (length - 2,), generator=g)
        mask[i, :length] = 1
    return ids, mask


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    return np.asarray((hidden * m).sum(1) / m.sum(1), dtype=np.float64)


def embedding_fidelity(reference: np.ndarray, other: np.ndarray, k: int = 10) -> dict[str, float]:
    """Mean cosine per sentence, top-k neighbour overlap, SQNR of the pooled embeddings."""

    def unit(e: np.ndarray) -> np.ndarray:
        return np.asarray(e / np.linalg.norm(e, axis=1, keepdims=True))

    a, b = unit(reference), unit(other)
    cosine = float(np.mean(np.sum(a * b, axis=1)))

    def neighbours(e: np.ndarray) -> np.ndarray:
        sim = e @ e.T
        np.fill_diagonal(sim, -np.inf)
        return np.argsort(-sim, axis=1)[:, :k]

    na, nb = neighbours(a), neighbours(b)
    overlap = float(np.mean([len(set(x) & set(y)) / k for x, y in zip(na, nb, strict=True)]))
    return {"cosine": cosine, "top10_overlap": overlap, "sqnr_db": sqnr(reference, other)}


class LastHiddenState(nn.Module):
    """``BertModel`` -> last_hidden_state only (for the ONNX export's single output)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bert(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
        return out


def bert_model() -> Any:
    """transformers' ``BertModel``: 6 layers, hidden 384, 12 heads, FFN 1536, seeded random
    init (nothing is downloaded)."""
    transformers = importlib.import_module("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=6, hidden_size=384, num_attention_heads=12, intermediate_size=1536
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def bert_suites(
    batches: Sequence[int], sentences: int, calib_sentences: int, trained_outliers: bool = False
) -> list[Suite]:
    bert = bert_model()
    config = bert.config
    model = LastHiddenState(bert).eval()
    ids, mask = random_sentences(sentences, config.vocab_size, seed=3)
    calib_ids, calib_mask = random_sentences(calib_sentences, config.vocab_size, seed=4)
    if trained_outliers:  # the activation statistics of a trained BERT (bert_zoo)
        settle = [(calib_ids[i : i + 8], calib_mask[i : i + 8]) for i in range(0, 32, 8)]
        add_trained_outliers(model, hf_bert_parts(bert), settle)
    eval_batch = max(batches)  # fidelity runs each column on this batch size
    with torch.no_grad():
        reference = np.concatenate(
            [
                _peers.to_numpy(model(ids[i : i + eval_batch], mask[i : i + eval_batch]))
                for i in range(0, sentences, eval_batch)
            ]
        )
    reference_pooled = mean_pooled(reference, mask.numpy())
    calib_pairs = [(calib_ids[i : i + 1], calib_mask[i : i + 1]) for i in range(calib_sentences)]

    # shared across batch sizes: the torch-side quantized models are shape-agnostic
    shared: dict[str, Any] = {}  # built object, or why building it failed

    def once(key: str, build: Callable[[], Any]) -> Any:
        """Build once for every batch size; a failure is re-reported, not retried."""
        if key not in shared:
            try:
                shared[key] = build()
            except Exception as e:
                shared[key] = e
        value = shared[key]
        if isinstance(value, Exception):
            raise value
        return value

    def torch_ao_dynamic() -> nn.Module:
        ao_q = _peers.require("torch.ao.quantization")
        _peers.quiet_torch_ao()
        torch.backends.quantized.engine = "x86"
        quantized: nn.Module = ao_q.quantize_dynamic(
            copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8
        )
        return quantized

    def quantbridge(mode: str) -> nn.Module:
        example = (calib_ids[:1], calib_mask[:1])
        if mode == "dynamic per token":  # int8 weights, each token's own activation scale
            backend = numba_backend.with_options(per_token_activations=True)
            prepared = prepare_fx(
                copy.deepcopy(bert), backend.qconfig_mapping(dynamic=True), example,
                backend_config=backend.backend_config, capture="export",
            )  # fmt: skip
            lowered: nn.Module = backend.convert(prepared)
            return lowered
        if mode == "dynamic":  # int8 per-channel Linear weights (7-bit on avx2)
            mapping = numba_backend.qconfig_mapping(dynamic=True)
        else:  # residual stream, norms and mask arithmetic float: the transformer mapping
            mapping = numba_backend.qconfig_mapping(transformer=True)
        source = bert
        if mode == "static recipe":  # outlier input channels in float (the README's recipe)
            source = keep_outlier_channels_float(bert, calib_pairs)
        return _quantbridge(source, mapping, example, calib_pairs, capture="export")

    suites = []
    for batch in batches:
        suite = Suite(f"bert batch {batch}")
        x_ids, x_mask = ids[:batch], mask[:batch]
        feeds = {"input_ids": x_ids.numpy(), "attention_mask": x_mask.numpy()}
        suite.add("fp32", functools.partial(torch_column, model, x_ids, x_mask))

        def torch_ao(x_ids: torch.Tensor = x_ids, x_mask: torch.Tensor = x_mask) -> Column:
            return torch_column(once("ao", torch_ao_dynamic), x_ids, x_mask)

        suite.add("torch.ao dynamic", torch_ao)

        def ort_dynamic(
            batch: int = batch,
            feeds: dict[str, np.ndarray] = feeds,
            x_ids: torch.Tensor = x_ids,
            x_mask: torch.Tensor = x_mask,
        ) -> Column:
            fp32 = _peers.onnx_export(
                model, (x_ids, x_mask), ["input_ids", "attention_mask"], WORK / f"bert{batch}.onnx"
            )
            return ort_column(
                _peers.ort_quantize_dynamic(fp32, WORK / f"bert{batch}.dyn.onnx"), feeds
            )

        suite.add("ORT dynamic", ort_dynamic)

        def openvino(feeds: dict[str, np.ndarray] = feeds, suite: Suite = suite) -> Column:
            calib = [{"input_ids": i.numpy(), "attention_mask": m.numpy()} for i, m in calib_pairs]
            example = {"input_ids": calib_ids[:1], "attention_mask": calib_mask[:1]}
            # one NNCF run; the converted model takes any batch size
            quantized = once(
                "ov", lambda: _peers.openvino_int8(model, example, calib, transformer=True)
            )
            suite.profiles["OpenVINO int8"] = functools.partial(
                _peers.openvino_layer_times, quantized, feeds
            )
            return openvino_column(quantized, feeds)

        suite.add("OpenVINO int8", openvino)
        for mode in ("dynamic", "dynamic per token", "static", "static recipe"):

            def qb(
                mode: str = mode,
                x_ids: torch.Tensor = x_ids,
                x_mask: torch.Tensor = x_mask,
                suite: Suite = suite,
            ) -> Column:
                lowered = once(f"qb {mode}", lambda: quantbridge(mode))
                with torch.no_grad():
                    lowered(x_ids, x_mask)
                suite.profiles[f"quantbridge {mode}"] = _module_times(lowered, x_ids, x_mask)
                return torch_column(lowered, x_ids, x_mask)

            suite.add(f"quantbridge {mode}", qb)
        suites.append(suite)

    # fidelity on every sentence, each column at batch ``eval_batch``
    fidelity_suite = next(s for s in suites if s.name == f"bert batch {eval_batch}")
    with torch.no_grad(), torch_threads(1):
        for column, make in list(fidelity_suite.columns.items()):
            if column == "fp32":
                continue
            saved_ids, saved_mask = ids.clone(), mask.clone()
            try:
                outs = []
                runner = make(1)
                for i in range(0, sentences, eval_batch):
                    # the runners read their bound inputs (views of ids/mask): refill in place
                    ids[:eval_batch].copy_(saved_ids[i : i + eval_batch])
                    mask[:eval_batch].copy_(saved_mask[i : i + eval_batch])
                    outs.append(runner())
                pooled = mean_pooled(np.concatenate(outs), saved_mask.numpy())
                for suite in suites:
                    if column in suite.columns:
                        suite.fidelity[column] = embedding_fidelity(reference_pooled, pooled)
            except Exception as e:
                fidelity_suite.errors[column] = f"fidelity failed: {short_error(e)}"
                traceback.print_exc(limit=4, file=sys.stderr)
            finally:
                ids.copy_(saved_ids)
                mask.copy_(saved_mask)
    for suite in suites:
        suite.notes.append(
            f"fidelity: {sentences} random sentences (8-128 tokens, padded to {BERT_SEQ}), "
            f"run at batch {eval_batch}, pooled over the mask; random-init weights"
        )
    return suites


# LSTM ------------------------------------------------------------------------------------------


class LSTMModel(nn.Module):
    """Two-layer LSTM, input and hidden 512, returning the output sequence only."""

    def __init__(self, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lstm(x)[0]
        return out


def lstm_suite(calib_batches: int) -> Suite:
    suite = Suite("lstm")
    torch.manual_seed(0)
    model = LSTMModel().eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, 512, generator=g)  # (sequence, batch, features)
    calib = [(torch.randn(64, 8, 512, generator=g),) for _ in range(calib_batches)]
    with torch.no_grad():
        reference = model(x).numpy()
    suite.add("fp32", lambda: torch_column(model, x))

    def torch_ao() -> Column:
        ao_q = _peers.require("torch.ao.quantization")
        _peers.quiet_torch_ao()
        torch.backends.quantized.engine = "x86"
        quantized = ao_q.quantize_dynamic(copy.deepcopy(model), {nn.LSTM}, dtype=torch.qint8)
        return torch_column(quantized, x)

    suite.add("torch.ao dynamic", torch_ao)

    def quantbridge() -> Column:
        mapping = QConfigMapping().set_object_type(
            nn.LSTM, numba_backend.qconfig_mapping(dynamic=True).object_type_qconfigs[nn.LSTM]
        )
        lowered = _quantbridge(model, mapping, (x,), calib)
        still_float = [n for n, m in lowered.named_modules() if type(m) is nn.LSTM]
        if still_float:
            suite.notes.append(
                "quantbridge dynamic: the numba backend leaves nn.LSTM in float today "
                f"({', '.join(still_float)} is torch's float LSTM): this column is fp32"
            )
        return torch_column(lowered, x)

    suite.add("quantbridge dynamic", quantbridge)
    with torch.no_grad(), torch_threads(1):
        for column, make in suite.columns.items():
            if column != "fp32":
                suite.fidelity[column] = {"sqnr_db": sqnr(reference, make(1)())}
    return suite


# --- timing and output ------------------------------------------------------------------------


def time_suite(suite: Suite, threads: int, rounds: int) -> dict[str, Any]:
    """Median and minimum ms per column at ``threads``, columns interleaved in every round."""
    errors = dict(suite.errors)
    runners: dict[str, Runner] = {}
    with torch_threads(threads), torch.no_grad():
        for name, make in suite.columns.items():
            try:
                runner = make(threads)
                runner()  # first-call costs (compilation, allocation) outside the timing
                runners[name] = runner
            except Exception as e:
                errors[name] = short_error(e)
        samples: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner()
                samples[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    fastest = {k: min(v) * 1e3 for k, v in samples.items()}
    fp32 = [k for k in suite.fp32_variants if k in median]
    fp32_ms = min((median[k] for k in fp32), default=None)
    return {
        "model": suite.name,
        "threads": threads,
        "rounds": rounds,
        "load_average_1min": os.getloadavg()[0],
        "ms": median,
        "min_ms": fastest,
        "fp32_ms": fp32_ms,
        "fp32_layout": min(fp32, key=lambda k: median[k]) if fp32 else None,
        "errors": errors,
        "fidelity": suite.fidelity,
        "notes": suite.notes,
    }


def _part_name(module: nn.Module) -> str:
    """A lowered module's part of the profile: its class, and a conv's kernel size."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if name.startswith("QuantizedConv") and isinstance(weight, torch.Tensor) and weight.dim() == 4:
        groups = int(getattr(module, "groups", 1))
        depthwise = groups > 1 and groups == weight.shape[0]
        name += " depthwise" if depthwise else f" {weight.shape[2]}x{weight.shape[3]}"
    return name


def _module_times(model: nn.Module, *args: Any) -> Callable[[int], Callable[[], dict[str, float]]]:
    """A per-part timer of a lowered model: µs in each kind of kernel module (the outermost
    module call: its array form or its forward), the rest of the forward ("between the kernel
    modules": torch ops, argument handling) and "total". The timing wrappers are put on the
    modules for each profiled forward only, so timed runs never see them."""
    times: dict[str, float] = {}
    depth = [0]
    modules = [m for m in model.modules() if isinstance(m, LoweredModule)]

    def wrap(module: nn.Module, attr: str) -> Any:
        inner = getattr(module, attr)
        key = _part_name(module)

        def timed(*a: Any) -> Any:
            if depth[0]:  # inside another module's call: counted there
                return inner(*a)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return inner(*a)
            finally:
                times[key] = times.get(key, 0.0) + (time.perf_counter() - start) * 1e6
                depth[0] -= 1

        return timed

    def make(threads: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            times.clear()
            saved = [
                (m, a, m.__dict__.get(a)) for m in modules for a in ("forward", "forward_arrays")
            ]
            for m, a, _ in saved:
                setattr(m, a, wrap(m, a))
            try:
                start = time.perf_counter()
                model(*args)
                total = (time.perf_counter() - start) * 1e6
            finally:
                for m, a, own in saved:  # the module as it was: its own attribute, or none
                    if own is None:
                        delattr(m, a)
                    else:
                        setattr(m, a, own)
            parts = dict(times)
            parts["between the kernel modules"] = total - sum(times.values())
            parts["total"] = total
            return parts

        return run

    return make


def profile_suite(suite: Suite, threads: int, rounds: int) -> dict[str, Any]:
    """Median µs per part of each profiled column at ``threads``, columns interleaved in every
    round (``--profile``)."""
    samples: dict[str, dict[str, list[float]]] = {}
    with torch_threads(threads), torch.no_grad():
        runners = {}
        for name, make in suite.profiles.items():
            try:
                runners[name] = make(threads)
            except Exception as e:  # a peer that cannot run here (its table says why)
                print(f"profile: {name} skipped: {type(e).__name__}: {str(e).splitlines()[0]}")
        for runner in runners.values():
            runner()  # first-call costs outside the figures
        for _ in range(rounds):
            for name, runner in runners.items():
                for part, us in runner().items():
                    samples.setdefault(name, {}).setdefault(part, []).append(us)
    parts = {
        name: {part: statistics.median(v) for part, v in by_part.items()}
        for name, by_part in samples.items()
    }
    return {"model": suite.name, "threads": threads, "rounds": rounds, "parts_us": parts}


def _print_profile(p: dict[str, Any], top: int = 12) -> None:
    print(
        f"\nprofile: {p['model']}, {p['threads']} thread(s), {p['rounds']} rounds: median µs "
        "per forward of each part (medians of parts need not add up to the total's)"
    )
    for column, parts in p["parts_us"].items():
        print(f"  {column}: total {parts['total'] / 1e3:.2f} ms")
        ranked = sorted(
            ((k, v) for k, v in parts.items() if k != "total" and v > 0), key=lambda kv: -kv[1]
        )
        for part, us in ranked[:top]:
            print(f"    {part:56s} {us:9.1f}")


def print_result(r: dict[str, Any]) -> None:
    print(
        f"\n{r['model']}, {r['threads']} thread(s), {r['rounds']} rounds, load average "
        f"{r['load_average_1min']:.1f}: median ms (min), speed vs fp32, fidelity vs fp32"
    )
    names = [*r["ms"], *(k for k in r["errors"] if k not in r["ms"])]
    width = max(len(k) for k in names)
    for name in names:
        if name not in r["ms"]:
            print(f"  {name:<{width}}  {r['errors'][name]}")
            continue
        ms = r["ms"][name]
        speed = f"{r['fp32_ms'] / ms:5.2f}x" if r["fp32_ms"] else "  n/a"
        figures = r["fidelity"].get(name, {})
        fid = "  ".join(
            f"{k} {v:.4f}" if k != "sqnr_db" else f"SQNR {v:.1f} dB" for k, v in figures.items()
        )
        why = f"  ({r['errors'][name]})" if name in r["errors"] else ""
        print(f"  {name:<{width}} {ms:9.2f} ({r['min_ms'][name]:8.2f}) {speed}  {fid}{why}")
    if r["fp32_layout"] and r["fp32_layout"] != "fp32":
        print(f"  (fp32 = the faster fp32 layout: {r['fp32_layout']})")
    for note in dict.fromkeys(r["notes"]):
        print(f"  note: {note}")


def _markdown(results: list[dict[str, Any]]) -> str:
    """One table row per model and column: ms per thread count, speed vs fp32, fidelity."""
    threads = sorted({r["threads"] for r in results})
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''} ms" for t in threads)
    lines = [
        f"| model | column | {head} | fidelity vs fp32 |",
        "| --- | --- |" + " --- |" * len(threads) + " --- |",
    ]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = {r["threads"]: r for r in results if r["model"] == model}
        columns = dict.fromkeys(k for r in rows.values() for k in [*r["ms"], *r["errors"]])
        for column in columns:
            cells = []
            for t in threads:
                r = rows.get(t)
                if r is None or column not in r["ms"]:
                    why = r["errors"].get(column, "n/a") if r else "n/a"
                    cells.append(why.replace("|", "/"))
                    continue
                ratio = f" ({r['fp32_ms'] / r['ms'][column]:.2f}x)" if r["fp32_ms"] else ""
                cells.append(f"{r['ms'][column]:.2f}{ratio}")
            figures = next((r["fidelity"].get(column) for r in rows.values()), None) or {}
            fid = ", ".join(
                f"SQNR {v:.1f} dB" if k == "sqnr_db" else f"{k} {v:.4f}" for k, v in figures.items()
            )
            lines.append(f"| {model} | {column} | {' | '.join(cells)} | {fid} |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_environment(isa: str | None) -> None:
    """torch's version, the CPU, the load, quantbridge's kernel target and the peers'
    versions: the first lines of a run."""
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {cpu_model()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start"
    )
    print(
        f"quantbridge kernel target {qk.best_target()}"
        + (f"; every runtime capped at {isa} (ONNX Runtime excepted)" if isa else "")
    )
    for peer in ("onnxruntime", "openvino", "nncf", "transformers", "onnx"):
        try:
            print(f"  {peer} {importlib.import_module(peer).__version__}")
        except Exception as e:
            print(f"  {peer}: {short_error(e)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS + OTHER_CNNS)
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calib-batches", type=int, default=8)
    parser.add_argument("--bert-batches", nargs="*", type=int, default=[1, 16])
    parser.add_argument(
        "--trained-outliers",
        action="store_true",
        help="give the BERT and the ViT the activation statistics of trained ones (outlier "
        "dimensions, massive activations; bert_zoo.add_trained_outliers, "
        "vit_model.add_trained_statistics) and add a column for the recipe "
        "(keep_outlier_channels_float before the transformer mapping)",
    )
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_CAPS),
        help="cap every runtime at this instruction set (ONNX Runtime excepted), to measure "
        "a CPU without the host's newer instructions",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each model's timings, time the parts of quantbridge's models (their "
        "kernel modules by kind, and what runs between them) beside OpenVINO's per-layer "
        "counters, interleaved round by round",
    )
    args = parser.parse_args()
    if args.sentences % max(args.bert_batches):
        parser.error("--sentences must be a multiple of the largest --bert-batches")

    print_environment(args.isa)

    results: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    for name in args.models:
        print(f"\n== {name}", flush=True)
        try:
            if name == "bert":
                suites = bert_suites(
                    args.bert_batches, args.sentences, args.calib_batches * 4,
                    trained_outliers=args.trained_outliers,
                )  # fmt: skip
            elif name == "lstm":
                suites = [lstm_suite(args.calib_batches)]
            else:
                suites = [
                    cnn_suite(name, args.calib_batches, 4, trained_outliers=args.trained_outliers)
                ]
        except Exception as e:  # e.g. transformers missing: the other models still run
            traceback.print_exc(limit=4, file=sys.stderr)
            print(f"  {name}: not run: {short_error(e)}")
            continue
        for suite in suites:
            for threads in args.threads:
                results.append(time_suite(suite, threads, args.rounds))
                print_result(results[-1])
            for threads in args.threads if args.profile and suite.profiles else ():
                profiles.append(profile_suite(suite, threads, args.rounds))
                _print_profile(profiles[-1])
    if results:
        print("\n" + _markdown(results))
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "cpu": cpu_model(),
                    "kernel_target": qk.best_target(),
                    "isa": args.isa,
                    "results": results,
                    "profiles": profiles,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
