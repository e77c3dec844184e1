"""The exported QDQ file (``quantbridge.fx_quant.export_onnx``) in ONNX Runtime and OpenVINO,
beside quantbridge's own kernels and ONNX Runtime's ``quantize_static``: the deployment table.

Run by ``nox -s bench_onnx`` (the packages of ``nox -s bench_peers``):

    python packages/lowering/bench/bench_onnx_export.py
        [--models resnet18 resnet50 mobilenet_v2 efficientnet_b0 bert] (also mobilenet_v3_small)
        [--threads 1 2] [--rounds 10] [--json OUT] [--isa avx2] [--float-logits]

Models, as ``bench_peers.py`` builds them: torchvision's architectures from
``tests/real_models.py`` (full size, seeded weights, batch 1, 3x224x224) and ``bert``
(transformers' ``BertModel``, 6 layers, hidden 384, random init; batch 1, random sentences
padded to 128 tokens with an attention mask). Columns, all from the same fp32 model and the
same calibration batches as ``bench_peers.py``:

* fp32: the eager model;
* quantbridge (numba): ``prepare_fx`` with ``get_backend("numba")``'s qconfig mapping (BERT:
  ``transformer=True``, captured with ``capture="export"``) and BackendConfig, calibrated,
  ``convert_to_reference_fx``, ``backend.lower``;
* the exported file: ``export_onnx(prepared, example_inputs, path)`` (profile "ort"), run by
  ONNX Runtime (``ORT_ENABLE_ALL``, ORT's default) and by OpenVINO (``read_model`` of the
  file, compiled for the CPU);
* ORT quantize_static: ``torch.onnx.export`` of the fp32 model, then ``quantize_static`` (QDQ,
  per-channel int8 weights, uint8 activations) through a CalibrationDataReader of the same
  batches; for BERT its MatMul and Gemm only, as the asv suite quantizes transformers.

Fidelity, at one thread on held-out inputs: SQNR (dB) of the logits against fp32 (BERT: of
the mean-pooled embeddings, with their mean cosine) for quantbridge's reference model, the
exported file in each runtime and ORT quantize_static. The file is the reference model
written in ONNX, so each model also prints how far each runtime's outputs are from the
reference model's: max |runtime - reference| in steps of the reference's coarsest activation
scale (the largest scale of any activation quantize in its graph).

Timing as in ``bench_peers.py``: one forward per column per round, columns interleaved, median
ms over ``--rounds``; threads per ``--threads`` count through ``torch.set_num_threads``, ORT's
``intra_op_num_threads`` and OpenVINO's ``INFERENCE_NUM_THREADS``. A column that fails prints
why and leaves its cell empty.
"""

from __future__ import annotations

import argparse
import copy
import json
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# bench_peers before torch and numba: its import applies --isa's caps to the environment they
# read when they load.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers
import numpy as np
import torch
from torch import fx, nn

import quantbridge.kernels as qk
from quantbridge.fx_quant import PrepareCustomConfig, convert_to_reference_fx, export_onnx
from quantbridge.lowering import get_backend
from quantbridge.qconfig import QConfigMapping

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "asv_bench" / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import _peers
import real_models

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "bert")
CHOICES = (*real_models.MODELS, "bert")
CALIB_BATCHES = 8  # bench_peers' default; BERT calibrates on 4 sentences per batch, as there
HELD_OUT_IMAGES = 4
HELD_OUT_SENTENCES = 64

# the table's columns: timed ones, then the SQNR of each quantized model against fp32
TIMED = {
    "fp32": "fp32 ms",
    "quantbridge numba": "quantbridge (numba) ms",
    "exported file in ORT": "exported file in ORT ms",
    "exported file in OpenVINO": "exported file in OpenVINO ms",
    "ORT quantize_static": "ORT quantize_static ms",
}
SCORED = {
    "quantbridge reference": "SQNR dB: quantbridge reference",
    "exported file in ORT": "SQNR: exported file in ORT",
    "exported file in OpenVINO": "SQNR: exported file in OpenVINO",
    "ORT quantize_static": "SQNR: ORT quantize_static",
}
# outputs compared with the reference model's, in quantization steps
FROM_REFERENCE = ("quantbridge numba", "exported file in ORT", "exported file in OpenVINO")

T = TypeVar("T")


def once(build: Callable[[], T]) -> Callable[[], T]:
    """``build``'s result, built on the first call; a failure is kept and raised again (several
    columns share one build, which should neither run twice nor be retried)."""
    memo: list[Any] = []

    def get() -> T:
        if not memo:
            try:
                memo.append(build())
            except Exception as e:
                memo.append(e)
        if isinstance(memo[0], Exception):
            raise memo[0]
        value: T = memo[0]
        return value

    return get


@dataclass
class Case:
    """One model, its inputs, its quantbridge recipe and how its outputs are scored."""

    name: str
    fp32: nn.Module  # timed, and what ORT quantize_static's torch.onnx.export reads
    source: nn.Module  # what quantbridge prepares (bench_peers': the BertModel itself)
    mapping: QConfigMapping
    example: tuple[torch.Tensor, ...]  # prepare_fx's and export_onnx's example inputs
    calib: list[tuple[torch.Tensor, ...]]
    # every column reads these tensors; the fidelity pass refills them in place
    inputs: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]  # of the fp32 ONNX export
    held_out: list[tuple[torch.Tensor, ...]]
    score: Callable[[np.ndarray, np.ndarray], dict[str, float]]
    prepare_args: dict[str, Any] = field(default_factory=dict)
    ort_op_types: tuple[str, ...] | None = None


def cnn_case(name: str, float_logits: bool = False) -> Case:
    model = real_models.build(name, full_size=True).eval()
    prepare_args: dict[str, Any] = {}
    if float_logits:
        prepare_args["prepare_custom_config"] = PrepareCustomConfig().set_output_float_indexes([0])
    held_out = bench_peers.calib_images(HELD_OUT_IMAGES, seed=2)
    x = held_out[0].clone()
    return Case(
        name=name,
        fp32=model,
        source=model,
        mapping=get_backend("numba").qconfig_mapping(),
        example=(x,),
        calib=[(c,) for c in bench_peers.calib_images(CALIB_BATCHES, seed=1)],
        inputs=(x,),
        input_names=("input",),
        held_out=[(h,) for h in held_out],
        score=lambda reference, other: {"sqnr_db": bench_peers.sqnr(reference, other)},
        prepare_args=prepare_args,
    )


def bert_case() -> Case:
    bert = bench_peers.bert_model()
    vocab = bert.config.vocab_size
    calib_ids, calib_mask = bench_peers.random_sentences(CALIB_BATCHES * 4, vocab, seed=4)
    ids, mask = bench_peers.random_sentences(HELD_OUT_SENTENCES, vocab, seed=3)

    def score(reference: np.ndarray, other: np.ndarray) -> dict[str, float]:
        pooled = [bench_peers.mean_pooled(hidden, mask.numpy()) for hidden in (reference, other)]
        return bench_peers.embedding_fidelity(*pooled)

    return Case(
        name="bert",
        fp32=bench_peers.LastHiddenState(bert).eval(),
        source=bert,
        mapping=get_backend("numba").qconfig_mapping(transformer=True),
        example=(calib_ids[:1], calib_mask[:1]),
        calib=[(calib_ids[i : i + 1], calib_mask[i : i + 1]) for i in range(len(calib_ids))],
        inputs=(ids[:1].clone(), mask[:1].clone()),
        input_names=("input_ids", "attention_mask"),
        held_out=[(ids[i : i + 1], mask[i : i + 1]) for i in range(len(ids))],
        score=score,
        prepare_args={"capture": "export"},
        ort_op_types=("MatMul", "Gemm"),
    )


def coarsest_activation_scale(reference: fx.GraphModule) -> float:
    """The largest scale of any activation quantize (constant scale, input not a weight) in the
    reference graph: one step of the coarsest grid that values pass through."""
    quantize = (
        torch.ops.quantbridge.quantize_per_tensor.default,
        torch.ops.quantbridge.quantize_per_tensor.tensor,
    )
    scales = []
    for node in reference.graph.nodes:
        if node.target not in quantize:
            continue
        source, scale = node.args[0], node.args[1]
        if isinstance(source, fx.Node) and source.op == "get_attr":
            continue
        if isinstance(scale, fx.Node) and scale.op == "get_attr":
            scales.append(float(operator.attrgetter(str(scale.target))(reference)))
        elif isinstance(scale, int | float):
            scales.append(float(scale))
    return max(scales)


def _file_feeds(path: Path, inputs: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    """``inputs`` (sharing their memory) under the exported file's input names, in order."""
    onnx = _peers.require("onnx")
    graph = onnx.load(str(path)).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    return {name: t.numpy() for name, t in zip(names, inputs, strict=True)}


def _outputs_on(runner: Callable[[], np.ndarray], case: Case) -> np.ndarray:
    """``runner``'s outputs on every held-out batch (refilling the bound inputs), concatenated;
    the bound inputs are restored after."""
    saved = [t.clone() for t in case.inputs]
    try:
        outs = []
        for batch in case.held_out:
            for bound, value in zip(case.inputs, batch, strict=True):
                bound.copy_(value)
            outs.append(runner())
        return np.concatenate(outs)
    finally:
        for bound, value in zip(case.inputs, saved, strict=True):
            bound.copy_(value)


def build_suite(case: Case) -> tuple[bench_peers.Suite, dict[str, float]]:
    """The timed columns of ``case`` with their fidelity, and the distances from the reference
    model in quantization steps (column -> steps)."""
    suite = bench_peers.Suite(case.name)
    backend = get_backend("numba")
    suite.notes.append(f"quantbridge numba: get_backend('numba'), kernel target {backend.target}")
    feeds = {name: t.numpy() for name, t in zip(case.input_names, case.inputs, strict=True)}

    prepared = once(
        lambda: bench_peers.prepare_calibrated(
            case.source, case.mapping, case.example, case.calib, **case.prepare_args
        )
    )
    reference = once(
        lambda: convert_to_reference_fx(
            copy.deepcopy(prepared()), backend_config=backend.backend_config
        )
    )

    def export() -> Path:
        path = bench_peers.WORK / f"{case.name}.export_onnx.onnx"
        report = export_onnx(prepared(), case.example, path)
        suite.notes.append(
            f"export_onnx: opset {report.opset}, {report.activation_quantizers} activation "
            f"quantizers, {len(report.weights)} int8 weights, {len(report.clipped)} clipped, "
            f"{report.removed_clamps} clamps removed, dynamic axes {report.dynamic_axes}"
        )
        return path

    exported = once(export)

    def numba() -> bench_peers.Column:
        return bench_peers.torch_column(backend.lower(reference()), *case.inputs)

    def file_in_ort() -> bench_peers.Column:
        return bench_peers.ort_column(exported(), _file_feeds(exported(), case.inputs))

    def file_in_openvino() -> bench_peers.Column:
        ov = _peers.require("openvino")
        ov_model = ov.Core().read_model(str(exported()))
        return bench_peers.openvino_column(ov_model, _file_feeds(exported(), case.inputs))

    def ort_quantize_static() -> bench_peers.Column:
        fp32 = _peers.onnx_export(
            case.fp32, case.inputs, case.input_names, bench_peers.WORK / f"{case.name}.fp32.onnx"
        )
        calib = [
            {name: t.numpy() for name, t in zip(case.input_names, batch, strict=True)}
            for batch in case.calib
        ]
        int8 = _peers.ort_quantize_static(
            fp32,
            calib,
            bench_peers.WORK / f"{case.name}.quantize_static.onnx",
            op_types=case.ort_op_types,
        )
        return bench_peers.ort_column(int8, feeds)

    suite.add("fp32", lambda: bench_peers.torch_column(case.fp32, *case.inputs))
    suite.add("quantbridge numba", numba)
    suite.add("exported file in ORT", file_in_ort)
    suite.add("exported file in OpenVINO", file_in_openvino)
    suite.add("ORT quantize_static", ort_quantize_static)
    if case.ort_op_types:
        suite.notes.append(f"ORT quantize_static: {', '.join(case.ort_op_types)} only")

    # fidelity, one thread: every column and the reference model on the held-out inputs
    steps: dict[str, float] = {}
    with torch.no_grad(), bench_peers.torch_threads(1):
        fp32_out = _outputs_on(suite.columns["fp32"](1), case)
        outputs: dict[str, np.ndarray] = {}
        try:
            outputs["quantbridge reference"] = _outputs_on(
                bench_peers.torch_column(reference(), *case.inputs)(1), case
            )
            suite.fidelity["quantbridge reference"] = case.score(
                fp32_out, outputs["quantbridge reference"]
            )
        except Exception as e:
            suite.errors["quantbridge reference"] = bench_peers.short_error(e)
        for column, make in list(suite.columns.items()):
            if column == "fp32":
                continue
            try:
                outputs[column] = _outputs_on(make(1), case)
                suite.fidelity[column] = case.score(fp32_out, outputs[column])
            except Exception as e:
                suite.errors[column] = bench_peers.short_error(e)
                del suite.columns[column]
        if "quantbridge reference" in outputs:
            step = coarsest_activation_scale(reference())
            for column in FROM_REFERENCE:
                if column in outputs:
                    gap = np.abs(outputs[column] - outputs["quantbridge reference"]).max()
                    steps[column] = float(gap) / step
            suite.notes.append(f"reference's coarsest activation scale {step:.4g}")
    return suite, steps


def _sqnr_cell(figures: dict[str, float] | None) -> str:
    if not figures:
        return ""
    cosine = f" (cos {figures['cosine']:.5f})" if "cosine" in figures else ""
    return f"{figures['sqnr_db']:.1f}{cosine}"


def markdown(results: list[dict[str, Any]]) -> str:
    """One row per model and thread count: median ms per column, SQNR per quantized model
    (BERT: of the pooled embeddings, with their mean cosine); a failed column's cell is
    empty."""
    head = [*TIMED.values(), *SCORED.values()]
    lines = [
        "| model | threads | " + " | ".join(head) + " |",
        "| --- | --- |" + " --- |" * len(head),
    ]
    for r in results:
        times = [f"{r['ms'][k]:.2f}" if k in r["ms"] else "" for k in TIMED]
        scores = [_sqnr_cell(r["fidelity"].get(k)) for k in SCORED]
        lines.append(f"| {r['model']} | {r['threads']} | " + " | ".join(times + scores) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=CHOICES)
    parser.add_argument("--threads", nargs="*", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--isa",
        choices=sorted(bench_peers.ISA_CAPS),
        help="cap every runtime at this instruction set (ONNX Runtime excepted), as "
        "bench_peers.py does",
    )
    parser.add_argument(
        "--float-logits",
        action="store_true",
        help="CNNs: leave the logits float (PrepareCustomConfig().set_output_float_indexes([0])) "
        "in quantbridge's model and the exported file",
    )
    args = parser.parse_args()
    bench_peers.print_environment(args.isa)

    results: list[dict[str, Any]] = []
    for name in args.models:
        print(f"\n== {name}", flush=True)
        try:
            case = bert_case() if name == "bert" else cnn_case(name, args.float_logits)
            suite, steps = build_suite(case)
        except Exception as e:  # e.g. transformers missing: the other models still run
            print(f"  {name}: not run: {bench_peers.short_error(e)}")
            continue
        for column in FROM_REFERENCE:
            if column in steps:
                print(f"  max |{column} - quantbridge reference|: {steps[column]:.2f} steps")
        for threads in args.threads:
            result = bench_peers.time_suite(suite, threads, args.rounds)
            result["steps_from_reference"] = steps
            results.append(result)
            bench_peers.print_result(result)
    if results:
        print("\n" + markdown(results))
        failed = {(r["model"], k): why for r in results for k, why in r["errors"].items()}
        for (model, column), why in failed.items():
            print(f"  {model}, {column}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "cpu": bench_peers.cpu_model(),
                    "kernel_target": qk.best_target(),
                    "isa": args.isa,
                    "results": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
