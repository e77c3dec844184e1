"""Weight-only quantized decoder LLMs on the CPU: quantbridge beside torchao, OpenVINO, llama.cpp.

Run by ``nox -s bench_llm`` (the only session that installs torchao, gguf and llama-cpp-python,
the last compiled there for this CPU):

    python packages/lowering/bench/bench_llm.py [--config tinyllama|tiny] [--layers N ...]
        [--threads 1 2] [--rounds 3] [--columns fp32 llama.cpp ...] [--json OUT]

The model: transformers' ``LlamaForCausalLM`` from a ``LlamaConfig``, TinyLlama's shape by
default (22 layers, hidden 2048, FFN 5632, 32 heads, 4 KV heads, vocab 32000, default rope,
untied embeddings; 1.1B parameters, 4.4 GB in fp32), or ``--config tiny`` (2 layers, hidden 256,
FFN 768 (a multiple of 128, for the int4 groups), 8 heads, 2 KV heads, vocab 1024) for smoke
runs; ``--layers/--hidden/...`` override. Every weight is drawn from normal(0, 0.02) with a
fixed seed, the RMSNorm weights are 1; the prompts are random token ids (fixed seeds). Nothing
is downloaded. The same weights go into every column:

* ``fp32 torch``: ``model.generate`` (greedy, ``use_cache=True``), the reference;
* ``torchao int8`` / ``int4 gG``: ``quantize_`` with ``Int8WeightOnlyConfig()`` (per output
  channel) and, for int4, torchao's CPU int4 layout (``PrototypeInt4WeightOnlyConfig``:
  ``Int4OpaqueTensor``, the ``_weight_int4pack_mm_for_cpu`` kernel, asymmetric, group G), eager
  (no ``torch.compile``), then ``model.generate``;
* ``OpenVINO int8`` / ``int4 gG``: the decoder written as one function of (token ids, the
  positions whose logits are wanted, the KV cache as tensors) over the same modules,
  ``openvino.convert_model``'d, made stateful (the KV cache in OpenVINO's state, as in
  OpenVINO's LLM docs), then ``nncf.compress_weights`` with ``INT8_ASYM`` or ``INT4_SYM``
  (group G, ``ratio=1``, ``all_layers=True``: the lm_head and embedding too); a greedy loop
  over the stateful infer request (``reset_state`` per sequence);
* ``llama.cpp Q8_0`` / ``Q4_0``: a GGUF file written with the ``gguf`` package from the same
  tensors (llama architecture, no vocabulary: token ids only; Q and K rows permuted as
  llama.cpp's ``convert_hf_to_gguf.py`` does; every 2-D tensor, embedding and output too,
  quantized by ``gguf.quants``, norms F32), run through llama-cpp-python's C API (one context
  per thread count, KV cache f16 by default);
* ``ORT int8 gG`` / ``int4 gG``: the same decoder function exported to ONNX (the TorchScript
  exporter), ``MatMulNBitsQuantizer`` (symmetric, blocks of G, accuracy level 4: int8
  activations; every MatMul, the lm_head too, the embedding fp32), a greedy loop passing the
  KV cache in and out as arrays (ONNX Runtime keeps no state);
* ``quantbridge int8 gG`` / ``int4 gG``: ``quantbridge_weight_only`` below (the numba
  backend's ``quantize_weights``, being built: every Linear in symmetric groups, the
  embedding float), then ``model.generate``; "not available" while the API is missing.

G: ``--group-sizes`` (128 and 32). int8: per channel for torchao and OpenVINO, blocks of 32
for llama.cpp's Q8_0, of the smallest G for ORT and quantbridge. OpenVINO's CPU plugin runs
with its defaults (on a CPU with AVX512-BF16: bf16 activations and a u8 KV cache; the output
notes them), which ``--openvino-config INFERENCE_PRECISION_HINT=f32 ...`` overrides.

Figures per column at batch 1, per ``--threads`` count (``torch.set_num_threads`` and
``quantbridge.kernels.set_num_threads``; OpenVINO ``INFERENCE_NUM_THREADS``, one compiled
model per count; llama.cpp ``n_threads``/``n_threads_batch``, one context per count):

* decode tokens/s: ``--new-tokens`` (128) greedy tokens after a ``--prompt`` (128) token
  prompt, the tokens after the first over the time after the first (the prefill excluded);
* prefill tokens/s: a ``--prefill`` (512) token prompt over the time to its first token;
* resident weight bytes: the quantized weight storage (torch: every tensor the model holds,
  quantized ones by their parts; llama.cpp: the GGUF tensor data; OpenVINO: the compressed
  model's constants), and the bytes a decoded token streams (the same less the embedding
  table, of which a token reads one row), which with the measured bandwidth gives the
  bandwidth bound printed beside decode tokens/s;
* fidelity against fp32 on the ``--prefill`` prompt: SQNR (dB) of the logits at every
  position, the fraction of positions whose top-1 next token is fp32's, and how many of the
  decode run's greedy tokens equal fp32's before the first difference.

Timing: columns interleaved within each round (each runs its decode, then its prefill),
medians over ``--rounds``. ``--columns`` runs fewer: every column of TinyLlama's shape at once
holds some 15-20 GB (the fp32 model, each quantized copy, OpenVINO's and ONNX Runtime's
compiled copies; the GGUF and ONNX files, a few GB, go to a temporary directory). The memory
bandwidth is a streaming read (numpy reductions, one slice per thread) of a buffer as large as
a Q4_0 copy of the model's matrices.

``--check`` (default on below 200M parameters) first runs llama.cpp on an F32 GGUF (which
checks the Q/K permutation), OpenVINO's converted fp32 model (the whole prompt, and single
steps through its stateful cache) and ONNX Runtime's fp32 export against torch on 64 tokens:
their logits must match torch's within 1e-2 relative.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import ctypes
import functools
import importlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# bench_peers applies ``--isa`` (its ISA_CAPS) when imported, before numba and the runtimes
# load; ``nox -s bench_llm`` builds llama.cpp for that level (``-DGGML_NATIVE=OFF`` and the
# level's flags) instead of for this CPU.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
from bench_peers import (
    ISA_CAPS,
    NotAvailableError,
    cpu_model,
    short_error,
    sqnr,
    torch_threads,
)
from torch import nn

import quantbridge.kernels as qk

CONFIGS: dict[str, dict[str, int]] = {
    # TinyLlama-1.1B's shape
    "tinyllama": {
        "layers": 22, "hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4,
        "vocab": 32000,
    },
    # smoke runs: every row a multiple of 128 (int4 groups of 32 and 128)
    "tiny": {
        "layers": 2, "hidden": 256, "intermediate": 768, "heads": 8, "kv_heads": 2,
        "vocab": 1024,
    },
}  # fmt: skip
# transformers' LlamaForCausalLM (transformers is imported when the model is built)
LlamaLM = Any
SEED = 0
CHECK_TOLERANCE = 1e-2  # relative: max |logit - torch's| / max |torch's logit|
CHECK_PARAMETERS = 200_000_000  # --check's default: on below this many parameters

WORK = Path(tempfile.mkdtemp(prefix="qb-bench-llm-"))  # GGUF files, removed at exit
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def require(module: str) -> Any:
    """Import a peer, or NotAvailableError naming it when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NotAvailableError(f"{module.split('.')[0]} not installed ({e})") from e


def relative_error(reference: np.ndarray, other: np.ndarray) -> float:
    return float(np.max(np.abs(reference - other)) / np.max(np.abs(reference)))


# --- the model --------------------------------------------------------------------------------


def build_model(shape: dict[str, int]) -> LlamaLM:
    """``LlamaForCausalLM`` of ``shape``, weights normal(0, 0.02) from a fixed seed, norms 1."""
    transformers = require("transformers")
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model: LlamaLM = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            if parameter.dim() == 1:  # RMSNorm weights
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    model.requires_grad_(False)
    return model


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, vocab, (length,), generator=generator).tolist()
    return ids


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor; a tensor subclass (torchao's quantized weights) by its parts."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def module_bytes(module: nn.Module) -> int:
    """Every tensor and numpy array the module's submodules hold (parameters, buffers and
    plain attributes such as a kernel module's packed weights), each counted once."""
    seen: set[int] = set()
    total = 0

    def visit(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor | np.ndarray) and id(value) not in seen:
            seen.add(id(value))
            total += tensor_bytes(value) if isinstance(value, torch.Tensor) else value.nbytes
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)

    for m in module.modules():
        visit(vars(m))
    return total


# --- engines: one per column and thread count -------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]
    first_s: float  # the prompt's prefill and the first token
    total_s: float


class Engine(Protocol):
    def generate(self, ids: Sequence[int], new_tokens: int) -> Generation: ...

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...


class _Stamps:
    """A ``generate`` streamer that notes when each put arrives (the prompt's first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TorchEngine:
    """A transformers causal LM (fp32, torchao- or quantbridge-quantized): ``generate``."""

    def __init__(self, model: LlamaLM) -> None:
        self.model = model
        self.transformers = require("transformers")

    def generate(self, ids: Sequence[int], new_tokens: int) -> Generation:
        x = torch.tensor([list(ids)])
        config = self.transformers.GenerationConfig(
            do_sample=False,
            use_cache=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,  # random weights: no end of sequence
            pad_token_id=0,
            bos_token_id=None,
        )
        stamps = _Stamps()
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), generation_config=config, streamer=stamps
            )
            total = time.perf_counter() - start
        tokens: list[int] = out[0, len(ids) :].tolist()
        return Generation(tokens, stamps.times[1] - start, total)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        with torch.no_grad():
            out = self.model(torch.tensor([list(ids)]), use_cache=False)
        return np.asarray(out.logits[0].float().numpy())


# --- torchao ----------------------------------------------------------------------------------


def torchao_weight_only(model: nn.Module, bits: int, group_size: int | None) -> nn.Module:
    """torchao's weight-only int8 (per channel) or int4 (``group_size``, CPU layout) model."""
    quantization = require("torchao.quantization")
    if bits == 8:
        config = quantization.Int8WeightOnlyConfig()
    else:
        try:  # torchao >= 0.16: the CPU int4 layout is a prototype config
            int4 = require("torchao.prototype.quantization.int4")
            config = int4.PrototypeInt4WeightOnlyConfig(group_size=group_size)
        except (NotAvailableError, AttributeError):  # older: a packing format of the config
            config = quantization.Int4WeightOnlyConfig(
                group_size=group_size, int4_packing_format="opaque"
            )
    quantized = copy.deepcopy(model)
    quantization.quantize_(quantized, config)
    return quantized


# --- quantbridge ------------------------------------------------------------------------------


def quantbridge_weight_only(model: nn.Module, bits: int, group_size: int) -> nn.Module:
    """quantbridge's weight-only model, a copy of ``model``: ``NumbaBackend.quantize_weights``
    with ``qconfig_mapping(weight_only=True)``: every ``nn.Linear`` (the lm_head too) in
    groups of ``group_size``, symmetric; the embedding float."""
    from quantbridge.lowering import get_backend

    backend: Any = get_backend("numba")
    mapping = backend.qconfig_mapping(weight_only=True, weight_bits=bits, group_size=group_size)
    quantized: nn.Module = backend.quantize_weights(model, mapping)
    return quantized


# --- OpenVINO ---------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVDecoder(nn.Module):
    """The Llama decoder as one function for ``openvino.convert_model``: (token ids, the
    positions whose logits are wanted, past keys and values per layer) -> (those logits,
    present keys and values). The model's own modules (embedding, norms, projections, MLP,
    lm_head) on HF Llama's math (rotary embedding, grouped-query attention); positions follow
    the cache's length."""

    inv_freq: torch.Tensor

    def __init__(self, model: LlamaLM) -> None:
        super().__init__()
        config = model.config
        self.embed = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        theta = float(config.rope_parameters["rope_theta"])
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponent, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        length = input_ids.shape[1]
        past_length = past[0].shape[2]
        positions = torch.arange(length, dtype=torch.float32) + past_length
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        keys = torch.arange(length + past_length)
        mask = keys[None, :] <= (torch.arange(length) + past_length)[:, None]
        hidden = self.embed(input_ids)
        presents: list[torch.Tensor] = []
        n_rep = self.heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, length, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k = torch.cat((past[2 * i], k), dim=2)
            v = torch.cat((past[2 * i + 1], v), dim=2)
            presents += [k, v]
            total = k.shape[2]
            k = k[:, :, None].expand(1, self.kv_heads, n_rep, total, self.head_dim)
            v = v[:, :, None].expand(1, self.kv_heads, n_rep, total, self.head_dim)
            k = k.reshape(1, self.heads, total, self.head_dim)
            v = v.reshape(1, self.heads, total, self.head_dim)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, length, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.norm(hidden).index_select(1, logits_index)
        return (self.lm_head(hidden), *presents)


def openvino_stateful(model: LlamaLM) -> Any:
    """``openvino.convert_model`` of ``KVDecoder(model)``, its KV cache made OpenVINO state."""
    ov = require("openvino")
    transformations = require("openvino._offline_transformations")
    decoder = KVDecoder(model).eval()
    layers = len(decoder.layers)
    cache_shape = (1, decoder.kv_heads, 2, decoder.head_dim)
    example = (
        torch.zeros(1, 3, dtype=torch.long),
        torch.tensor([2]),
        *(torch.zeros(cache_shape) for _ in range(2 * layers)),
    )
    cache = ov.PartialShape([1, decoder.kv_heads, -1, decoder.head_dim])
    shapes = [ov.PartialShape([1, -1]), ov.PartialShape([-1]), *[cache] * (2 * layers)]
    with torch.no_grad():
        ov_model = ov.convert_model(decoder, example_input=example, input=shapes)
    names = [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    for port, name in zip(ov_model.inputs, ["input_ids", "logits_index", *names], strict=True):
        port.get_tensor().set_names({name if "." not in name else f"past.{name}"})
    for port, name in zip(ov_model.outputs, ["logits", *names], strict=True):
        port.get_tensor().set_names({name if "." not in name else f"present.{name}"})
    transformations.apply_make_stateful_transformation(
        ov_model, {f"past.{n}": f"present.{n}" for n in names}
    )
    return ov_model


def openvino_compress(ov_model: Any, bits: int, group_size: int | None) -> Any:
    """NNCF's weight compression of a copy: INT8_ASYM per channel, or INT4_SYM in groups of
    ``group_size`` for every layer (embedding and lm_head too, ratio 1)."""
    nncf = require("nncf")
    if bits == 8:
        return nncf.compress_weights(ov_model.clone(), mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(
        ov_model.clone(),
        mode=nncf.CompressWeightsMode.INT4_SYM,
        group_size=group_size,
        ratio=1.0,
        all_layers=True,
    )


def openvino_bytes(ov_model: Any, embedding: str = "embed") -> tuple[int, int]:
    """Bytes of the model's constants, and of those whose name says they are the embedding."""
    total = embedded = 0
    for op in ov_model.get_ops():
        if op.get_type_name() == "Constant":
            size = int(op.get_byte_size())
            total += size
            if embedding in op.get_friendly_name():
                embedded += size
    return total, embedded


class OpenVINOEngine:
    """A greedy loop over a stateful OpenVINO model compiled for ``threads`` threads."""

    def __init__(self, ov_model: Any, threads: int, config: dict[str, Any] | None = None) -> None:
        ov = require("openvino")
        options = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        options.update({"NUM_STREAMS": 1, **(config or {})})
        self.compiled = ov.Core().compile_model(ov_model, "CPU", options)
        self.request = self.compiled.create_infer_request()

    def _infer(self, ids: np.ndarray, index: np.ndarray) -> np.ndarray:
        self.request.infer({"input_ids": ids, "logits_index": index})
        return np.asarray(self.request.get_output_tensor(0).data)

    def generate(self, ids: Sequence[int], new_tokens: int) -> Generation:
        self.request.reset_state()
        start = time.perf_counter()
        prompt = np.array([list(ids)], dtype=np.int64)
        token = int(self._infer(prompt, np.array([len(ids) - 1]))[0, -1].argmax())
        first = time.perf_counter() - start
        tokens = [token]
        step, last = np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64)
        for _ in range(new_tokens - 1):
            step[0, 0] = token
            token = int(self._infer(step, last)[0, 0].argmax())
            tokens.append(token)
        return Generation(tokens, first, time.perf_counter() - start)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        self.request.reset_state()
        prompt = np.array([list(ids)], dtype=np.int64)
        return np.array(self._infer(prompt, np.arange(len(ids)))[0], dtype=np.float32)

    def properties(self) -> str:
        names = (
            "INFERENCE_PRECISION_HINT",
            "KV_CACHE_PRECISION",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE",
        )
        found = []
        for name in names:
            with suppress(Exception):  # a property this version does not have
                found.append(f"{name} {self.compiled.get_property(name)}")
        return ", ".join(found)


# --- ONNX Runtime -----------------------------------------------------------------------------


def onnx_decoder(model: LlamaLM, path: Path) -> list[str]:
    """``KVDecoder(model)`` exported to ONNX (the TorchScript exporter: dynamic lengths by
    name), weights in an external data file; returns the cache's input names."""
    decoder = KVDecoder(model).eval()
    layers = len(decoder.layers)
    names = [f"{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    past, present = [f"past.{n}" for n in names], [f"present.{n}" for n in names]
    example = (
        torch.zeros(1, 3, dtype=torch.long),
        torch.tensor([2]),
        *(torch.zeros(1, decoder.kv_heads, 2, decoder.head_dim) for _ in range(2 * layers)),
    )
    dynamic = {"input_ids": {1: "length"}, "logits_index": {0: "kept"}, "logits": {1: "kept"}}
    dynamic |= {p: {2: "past"} for p in past} | {p: {2: "total"} for p in present}
    require("onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            decoder, example, str(path), input_names=["input_ids", "logits_index", *past],
            output_names=["logits", *present], dynamic_axes=dynamic, dynamo=False,
            opset_version=17, external_data=True,
        )  # fmt: skip
    return past


def ort_matmul_nbits(source: Path, out: Path, bits: int, block_size: int) -> tuple[int, int]:
    """ORT's ``MatMulNBitsQuantizer`` (symmetric, blocks of ``block_size`` along the input,
    accuracy level 4: int8 activations) over every MatMul with a constant weight; the
    embedding (a Gather) stays fp32. Returns the initializers' bytes and the embedding's."""
    onnx = require("onnx")
    nbits = require("onnxruntime.quantization.matmul_nbits_quantizer")
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    quantizer = nbits.MatMulNBitsQuantizer(
        str(source), bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=4
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=True)
    total = embedded = 0
    for init in quantizer.model.model.graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        size = int(np.prod(init.dims, dtype=np.int64)) * itemsize
        total += size
        embedded += size if "embed" in init.name else 0
    return total, embedded


class ORTEngine:
    """An ONNX Runtime session on ``threads`` threads; the KV cache goes out and back in as
    arrays at every step (ORT keeps no state)."""

    def __init__(self, path: Path, cache: list[str], cache_shape: tuple[int, ...], threads: int):
        ort = require("onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.cache, self.cache_shape = cache, cache_shape

    def _run(self, ids: np.ndarray, index: np.ndarray, past: list[np.ndarray]) -> list[Any]:
        feeds = {
            "input_ids": ids,
            "logits_index": index,
            **dict(zip(self.cache, past, strict=True)),
        }
        outputs: list[Any] = self.session.run(None, feeds)
        return outputs

    def generate(self, ids: Sequence[int], new_tokens: int) -> Generation:
        empty = [np.zeros(self.cache_shape, dtype=np.float32)] * len(self.cache)
        start = time.perf_counter()
        prompt = np.array([list(ids)], dtype=np.int64)
        logits, *past = self._run(prompt, np.array([len(ids) - 1]), empty)
        token = int(logits[0, -1].argmax())
        first = time.perf_counter() - start
        tokens = [token]
        last = np.zeros(1, dtype=np.int64)
        for _ in range(new_tokens - 1):
            logits, *past = self._run(np.array([[token]]), last, past)
            token = int(logits[0, 0].argmax())
            tokens.append(token)
        return Generation(tokens, first, time.perf_counter() - start)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        empty = [np.zeros(self.cache_shape, dtype=np.float32)] * len(self.cache)
        prompt = np.array([list(ids)], dtype=np.int64)
        return np.asarray(self._run(prompt, np.arange(len(ids)), empty)[0][0])


# --- llama.cpp --------------------------------------------------------------------------------


def _llama_permute(weights: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's row order for HF Llama's Q/K projections (convert_hf_to_gguf.py's
    ``LlamaModel.permute``): HF rotates the two halves of a head, llama.cpp adjacent pairs."""
    if kv_heads != heads:
        heads = kv_heads
    shape = weights.shape
    split = weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(shape))


def write_gguf(model: LlamaLM, path: Path, qtype: str) -> tuple[int, int]:
    """The model's tensors as a llama GGUF file without vocabulary, 2-D tensors in ``qtype``
    (F32, F16, Q8_0, Q4_0), norms F32. Returns the tensor data bytes and the embedding's."""
    gguf = require("gguf")
    config = model.config
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(int(config.head_dim))
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_tokenizer_model("none")  # token ids only (llama.cpp's LLAMA_VOCAB_TYPE_NONE)
    file_types = {
        "F32": "ALL_F32",
        "F16": "MOSTLY_F16",
        "Q8_0": "MOSTLY_Q8_0",
        "Q4_0": "MOSTLY_Q4_0",
    }
    writer.add_file_type(int(getattr(gguf.LlamaFileType, file_types[qtype])))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    total = embedded = 0
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise RuntimeError(f"no GGUF name for {hf_name}")
        data = tensor.detach().float().numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _llama_permute(data, heads, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _llama_permute(data, heads, kv_heads)
        if data.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            nbytes = data.size * 4
        elif qtype == "F16":
            writer.add_tensor(name, data.astype(np.float16))
            nbytes = data.size * 2
        else:
            packed = gguf.quants.quantize(data, quant)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=quant)
            nbytes = packed.nbytes
        total += nbytes
        embedded += nbytes if name.startswith("token_embd") else 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total, embedded


_LLAMA_LOG: Any = None  # llama.cpp's log callback (kept alive while the library may call it)


def _llama() -> Any:
    """llama-cpp-python's C API, llama.cpp's logging silenced."""
    global _LLAMA_LOG
    api = require("llama_cpp.llama_cpp")
    if _LLAMA_LOG is None:
        _LLAMA_LOG = api.llama_log_callback(lambda level, text, user_data: None)
        api.llama_log_set(_LLAMA_LOG, ctypes.c_void_p(0))
        api.llama_backend_init()
    return api


class LlamaCppModel:
    """A GGUF file loaded once (memory-mapped); ``engine(threads)`` gives a context."""

    def __init__(self, path: Path, n_ctx: int, n_batch: int) -> None:
        api = _llama()
        params = api.llama_model_default_params()
        self.model = api.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path.name}")
        self.n_vocab = int(api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model)))
        self.n_ctx, self.n_batch = n_ctx, n_batch

    def engine(self, threads: int) -> LlamaCppEngine:
        return LlamaCppEngine(self, threads)


class LlamaCppEngine:
    """A llama.cpp context on ``threads`` threads: the prompt in one batch, then a token at a
    time, greedy (argmax of the logits)."""

    def __init__(self, model: LlamaCppModel, threads: int) -> None:
        api = self.api = _llama()
        params = api.llama_context_default_params()
        params.n_ctx = model.n_ctx
        params.n_batch = params.n_ubatch = model.n_batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads
        self.ctx = api.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = api.llama_batch_init(model.n_batch, 0, 1)
        self.n_vocab = model.n_vocab
        self.model = model  # the model outlives its contexts

    def __del__(self) -> None:
        api = getattr(self, "api", None)
        if api is not None and getattr(self, "ctx", None):
            api.llama_batch_free(self.batch)
            api.llama_free(self.ctx)

    def _decode(self, tokens: Sequence[int], start: int, every_logit: bool) -> None:
        batch = self.batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = every_logit or i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        status = self.api.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _logits(self, i: int) -> np.ndarray:
        pointer = self.api.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def _reset(self) -> None:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)

    def generate(self, ids: Sequence[int], new_tokens: int) -> Generation:
        self._reset()
        start = time.perf_counter()
        self._decode(ids, 0, every_logit=False)
        token = int(self._logits(-1).argmax())
        first = time.perf_counter() - start
        tokens = [token]
        for position in range(len(ids), len(ids) + new_tokens - 1):
            self._decode([token], position, every_logit=False)
            token = int(self._logits(-1).argmax())
            tokens.append(token)
        return Generation(tokens, first, time.perf_counter() - start)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        self._reset()
        self._decode(ids, 0, every_logit=True)
        return np.stack([self._logits(i).copy() for i in range(len(ids))])


def llama_system_info() -> str:
    try:
        info: bytes = _llama().llama_print_system_info()
        return info.decode().strip()
    except Exception as e:
        return short_error(e)


# --- columns ----------------------------------------------------------------------------------


@dataclass
class Column:
    """One way to run the model: an engine per thread count and what its weights take."""

    engine: Callable[[int], Engine]
    weight_bytes: int
    streamed_bytes: int  # the weights a decoded token reads: all but the embedding table
    threads: Callable[[int | None], None] | None = None  # quantbridge's kernels' setting


@dataclass
class Suite:
    columns: dict[str, Column] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    fidelity: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)

    def add(self, name: str, build: Callable[[], Column]) -> Column | None:
        print(f"  building {name}", flush=True)
        start = time.perf_counter()
        try:
            column = build()
        except Exception as e:  # a peer that fails is a result, not the end of the run
            self.errors[name] = short_error(e)
            if not isinstance(e, NotAvailableError):
                traceback.print_exc(limit=6, file=sys.stderr)
            print(f"    {name}: {self.errors[name]}", flush=True)
            return None
        self.columns[name] = column
        print(f"    built in {time.perf_counter() - start:.1f} s", flush=True)
        return column


def torch_column(model: LlamaLM, threads: Callable[[int | None], None] | None = None) -> Column:
    embedding = model.get_input_embeddings()
    total = module_bytes(model)
    return Column(lambda t: TorchEngine(model), total, total - module_bytes(embedding), threads)


def build_suite(
    model: LlamaLM, wanted: Callable[[str], bool], group_sizes: Sequence[int], args: Any
) -> Suite:
    suite = Suite()
    suite.add("fp32 torch", lambda: torch_column(model))
    # the columns quantizing in blocks only (ORT, quantbridge): int8 in the smallest group
    int_columns = [(8, min(group_sizes, default=32)), *((4, g) for g in group_sizes)]

    if any(wanted(f"torchao {k}") for k in ("int8", "int4")):
        if wanted("torchao int8"):
            suite.add("torchao int8", lambda: torch_column(torchao_weight_only(model, 8, None)))
        for g in (g for g in group_sizes if wanted(f"torchao int4 g{g}")):
            suite.add(
                f"torchao int4 g{g}",
                lambda g=g: torch_column(torchao_weight_only(model, 4, g)),  # type: ignore[misc]
            )
        suite.notes.append(
            "torchao: eager (no torch.compile); int8 Int8WeightOnlyConfig (per channel), int4 "
            "the CPU layout (Int4OpaqueTensor, asymmetric, _weight_int4pack_mm_for_cpu); "
            "the embedding stays fp32"
        )

    if any(wanted(f"OpenVINO {k}") for k in ("int8", "int4")):
        stateful: dict[str, Any] = {}
        properties: list[str] = []  # the compiled model's precisions

        def openvino(bits: int, group_size: int | None) -> Column:
            if "model" not in stateful:
                stateful["model"] = openvino_stateful(model)
            compressed = openvino_compress(stateful["model"], bits, group_size)
            total, embedded = openvino_bytes(compressed)
            if not embedded:
                suite.notes.append("OpenVINO: no constant named like the embedding")
            engine = functools.partial(OpenVINOEngine, compressed, config=args.openvino_config)
            if not properties:
                properties.append(engine(1).properties())
            return Column(engine, total, total - embedded)

        if wanted("OpenVINO int8"):
            suite.add("OpenVINO int8", lambda: openvino(8, None))
        for g in (g for g in group_sizes if wanted(f"OpenVINO int4 g{g}")):
            suite.add(f"OpenVINO int4 g{g}", lambda g=g: openvino(4, g))  # type: ignore[misc]
        stateful.clear()
        suite.notes.append(
            "OpenVINO: nncf.compress_weights INT8_ASYM (per channel) / INT4_SYM (group, ratio 1, "
            "all_layers: embedding and lm_head too); compiled with "
            + ", ".join([*(f"{k} {v}" for k, v in args.openvino_config.items()), *properties])
        )

    n_ctx = max(args.prefill, args.prompt + args.new_tokens)
    n_ctx = -(-n_ctx // 256) * 256
    n_batch = max(args.prefill, args.prompt)

    def llama_cpp(qtype: str) -> Column:
        _llama()
        path = WORK / f"model-{qtype}.gguf"
        total, embedded = write_gguf(model, path, qtype)
        loaded = LlamaCppModel(path, n_ctx, n_batch)
        return Column(loaded.engine, total, total - embedded)

    for qtype in ("Q8_0", "Q4_0"):
        if wanted(f"llama.cpp {qtype}"):
            suite.add(f"llama.cpp {qtype}", lambda q=qtype: llama_cpp(q))  # type: ignore[misc]
    if wanted("llama.cpp"):
        suite.notes.append(
            "llama.cpp: GGUF written by the gguf package (gguf.quants Q8_0/Q4_0: blocks of 32, "
            "symmetric, fp16 scales; embedding and output quantized too, norms F32), "
            "llama-cpp-python's C API, KV cache f16 (llama.cpp's default)"
        )

    exported: dict[str, list[str]] = {}
    config = model.config
    cache_shape = (1, int(config.num_key_value_heads), 0, int(config.head_dim))

    def ort(bits: int, block_size: int) -> Column:
        source = WORK / "decoder.onnx"
        if "cache" not in exported:
            exported["cache"] = onnx_decoder(model, source)
        cache = exported["cache"]
        path = WORK / f"decoder-int{bits}-b{block_size}.onnx"
        total, embedded = ort_matmul_nbits(source, path, bits, block_size)
        return Column(lambda t: ORTEngine(path, cache, cache_shape, t), total, total - embedded)

    for bits, block in int_columns:
        if wanted(f"ORT int{bits} g{block}"):
            suite.add(f"ORT int{bits} g{block}", lambda b=bits, k=block: ort(b, k))  # type: ignore[misc]
    if wanted("ORT"):
        suite.notes.append(
            "ORT: the KVDecoder exported to ONNX (TorchScript exporter), MatMulNBitsQuantizer "
            "symmetric, accuracy level 4 (int8 activations), every MatMul (lm_head too), the "
            "embedding fp32; the KV cache passed in and out as arrays each step"
        )

    def quantbridge(bits: int, group_size: int) -> Column:
        return torch_column(quantbridge_weight_only(model, bits, group_size), qk.set_num_threads)

    for bits, group in int_columns:
        if wanted(f"quantbridge int{bits} g{group}"):
            suite.add(
                f"quantbridge int{bits} g{group}",
                lambda b=bits, g=group: quantbridge(b, g),  # type: ignore[misc]
            )
    if wanted("quantbridge"):
        suite.notes.append(
            "quantbridge: NumbaBackend.quantize_weights, every Linear (lm_head too) in groups, "
            "symmetric; the embedding float; generate() as for fp32"
        )
    return suite


def add_fidelity(
    suite: Suite, prefill_ids: Sequence[int], reference: np.ndarray, threads: int
) -> None:
    """SQNR and top-1 agreement of every column's logits on the prefill prompt."""
    top1 = reference.argmax(-1)
    for name, column in list(suite.columns.items()):
        if name == "fp32 torch":
            continue
        try:
            logits = column.engine(threads).logits(prefill_ids)
            suite.fidelity[name] = {
                "sqnr_db": sqnr(reference, logits),
                "top1": float(np.mean(logits.argmax(-1) == top1)),
            }
        except Exception as e:
            suite.errors[name] = f"fidelity failed: {short_error(e)}"
            traceback.print_exc(limit=6, file=sys.stderr)
            del suite.columns[name]


def run_checks(model: LlamaLM, ids: Sequence[int], reference: np.ndarray) -> list[str]:
    """llama.cpp on an F32 GGUF and OpenVINO's converted fp32 model (the whole prompt, then
    half of it followed by single-token steps through the stateful KV cache) against torch's
    logits on ``ids``: one line per check."""
    checks: list[str] = []

    def report(what: str, error: float) -> None:
        verdict = "ok" if error <= CHECK_TOLERANCE else f"FAILED (over {CHECK_TOLERANCE})"
        checks.append(f"{what} vs torch fp32: max relative logit error {error:.2e} {verdict}")
        print(f"  check: {checks[-1]}", flush=True)

    def failed(what: str, e: Exception) -> None:
        checks.append(f"{what}: not run: {short_error(e)}")
        if not isinstance(e, NotAvailableError):
            traceback.print_exc(limit=6, file=sys.stderr)
        print(f"  check: {checks[-1]}", flush=True)

    try:
        path = WORK / "model-F32.gguf"
        write_gguf(model, path, "F32")
        n_ctx = -(-len(ids) // 256) * 256
        engine = LlamaCppModel(path, n_ctx, len(ids)).engine(1)
        report("llama.cpp F32 GGUF", relative_error(reference, engine.logits(ids)))
        del engine
        path.unlink()
    except Exception as e:
        failed("llama.cpp F32 GGUF", e)
    try:
        ov = OpenVINOEngine(openvino_stateful(model), 1, {"INFERENCE_PRECISION_HINT": "f32"})
        report("OpenVINO fp32 (KVDecoder)", relative_error(reference, ov.logits(ids)))
        half = len(ids) // 2
        ov.request.reset_state()
        ov._infer(np.array([list(ids[:half])]), np.array([half - 1]))
        last = np.zeros(1, dtype=np.int64)
        steps = np.stack([ov._infer(np.array([[t]]), last)[0, 0].copy() for t in ids[half:]])
        report("OpenVINO fp32 stateful steps", relative_error(reference[half:], steps))
    except Exception as e:
        failed("OpenVINO fp32", e)
    try:
        source = WORK / "check-decoder.onnx"
        cache = onnx_decoder(model, source)
        shape = (1, int(model.config.num_key_value_heads), 0, int(model.config.head_dim))
        ort = ORTEngine(source, cache, shape, 1)
        report("ONNX Runtime fp32 (KVDecoder)", relative_error(reference, ort.logits(ids)))
    except Exception as e:
        failed("ONNX Runtime fp32", e)
    return checks


# --- bandwidth, timing and output -------------------------------------------------------------


def stream_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """GB/s of a streaming read of ``nbytes``: one slice per thread, each reduced by numpy
    (float32 max and uint64 bitwise or, vectorized reductions that keep up with the memory,
    where a float64 sum does not); the best of ``repeats`` of each."""
    buffer = np.ones(max(nbytes // 8, 1024), dtype=np.float64)
    reads: list[tuple[Callable[[np.ndarray], Any], list[np.ndarray]]] = [
        (np.max, np.array_split(buffer.view(np.float32), threads)),
        (np.bitwise_or.reduce, np.array_split(buffer.view(np.uint64), threads)),
    ]
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            for reduce, parts in reads:
                start = time.perf_counter()
                list(pool.map(reduce, parts))
                best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def time_columns(
    suite: Suite,
    threads: int,
    rounds: int,
    prompt: Sequence[int],
    prefill: Sequence[int],
    new_tokens: int,
    bandwidth: float,
) -> dict[str, Any]:
    """Median decode and prefill tokens/s per column at ``threads``, columns interleaved."""
    errors: dict[str, str] = {}
    engines: dict[str, Engine] = {}
    decode: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    with torch_threads(threads), torch.no_grad():
        for name, column in suite.columns.items():
            try:
                if column.threads is not None:
                    column.threads(threads)
                engine = column.engine(threads)
                engine.generate(prompt[:8], 2)  # first-call costs outside the timing
                engines[name] = engine
            except Exception as e:
                errors[name] = short_error(e)
                traceback.print_exc(limit=6, file=sys.stderr)
        for r in range(rounds):
            for name, engine in list(engines.items()):
                try:
                    run = engine.generate(prompt, new_tokens)
                    decode.setdefault(name, []).append(
                        (new_tokens - 1) / (run.total_s - run.first_s)
                    )
                    tokens.setdefault(name, run.tokens)
                    first.setdefault(name, []).append(engine.generate(prefill, 1).first_s)
                except Exception as e:
                    errors[name] = short_error(e)
                    traceback.print_exc(limit=6, file=sys.stderr)
                    del engines[name]
            print(f"  {threads} thread(s): round {r + 1}/{rounds} done", flush=True)
        for column in suite.columns.values():
            if column.threads is not None:
                column.threads(None)
    reference = tokens.get("fp32 torch")
    same = {}
    for name, generated in tokens.items():
        if reference is not None:
            diverge = [
                i for i, (a, b) in enumerate(zip(reference, generated, strict=True)) if a != b
            ]
            same[name] = diverge[0] if diverge else len(generated)
    return {
        "threads": threads,
        "rounds": rounds,
        "load_average_1min": os.getloadavg()[0],
        "bandwidth_gb_s": bandwidth,
        "decode_tok_s": {k: statistics.median(v) for k, v in decode.items()},
        "decode_tok_s_best": {k: max(v) for k, v in decode.items()},
        "prefill_tok_s": {k: len(prefill) / statistics.median(v) for k, v in first.items()},
        "ttft_ms": {k: statistics.median(v) * 1e3 for k, v in first.items()},
        "greedy_same_tokens": same,
        "errors": {**suite.errors, **errors},
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def print_result(r: dict[str, Any], suite: Suite, description: str, new_tokens: int) -> None:
    bw = r["bandwidth_gb_s"]
    print(
        f"\n{description}, {r['threads']} thread(s), {r['rounds']} rounds, load average "
        f"{r['load_average_1min']:.1f}, streaming read {bw:.1f} GB/s: median decode tok/s "
        "(bandwidth bound: GB/s over the bytes a token streams), prefill tok/s, weights, "
        "fidelity vs fp32"
    )
    names = [*suite.columns, *(k for k in r["errors"] if k not in suite.columns)]
    width = max(len(k) for k in names)
    for name in names:
        if name not in r["decode_tok_s"]:
            print(f"  {name:<{width}}  {r['errors'].get(name, 'not run')}")
            continue
        column = suite.columns[name]
        bound = bw * 1e9 / max(column.streamed_bytes, 1)
        fid = suite.fidelity.get(name)
        fidelity = f"SQNR {fid['sqnr_db']:5.1f} dB, top-1 {fid['top1']:.3f}" if fid else "reference"
        same = r["greedy_same_tokens"].get(name)
        greedy = (
            f", greedy = fp32 for {same}/{new_tokens} tokens" if fid and same is not None else ""
        )
        print(
            f"  {name:<{width}}  decode {r['decode_tok_s'][name]:8.2f} (bound {bound:8.1f})  "
            f"prefill {r['prefill_tok_s'][name]:8.1f}  weights {_mb(column.weight_bytes):>10} "
            f"({_mb(column.streamed_bytes)} per token)  {fidelity}{greedy}"
        )


def markdown(results: list[dict[str, Any]], suite: Suite) -> str:
    """One row per column: weights, decode and prefill tokens/s per thread count, fidelity."""
    threads = [r["threads"] for r in results]
    decode = " | ".join(f"decode tok/s {t}T" for t in threads)
    prefill = " | ".join(f"prefill tok/s {t}T" for t in threads)
    lines = [
        f"| column | weights MB | {decode} | {prefill} | SQNR dB | top-1 | greedy = fp32 |",
        "| --- | --- |" + " --- |" * (2 * len(threads)) + " --- | --- | --- |",
    ]
    names = [*suite.columns, *(k for k in suite.errors if k not in suite.columns)]
    for name in dict.fromkeys(names):
        column = suite.columns.get(name)
        if column is None:
            why = suite.errors.get(name, "n/a").replace("|", "/")
            lines.append(f"| {name} | {why} |" + " |" * (2 * len(threads) + 3))
            continue
        cells = [f"{column.weight_bytes / 1e6:.1f}"]
        for key in ("decode_tok_s", "prefill_tok_s"):
            for r in results:
                value = r[key].get(name)
                cells.append(f"{value:.2f}" if value is not None else r["errors"].get(name, "n/a"))
        fid = suite.fidelity.get(name)
        same = results[0]["greedy_same_tokens"].get(name) if results else None
        cells += (
            [f"{fid['sqnr_db']:.1f}", f"{fid['top1']:.3f}", str(same)]
            if fid
            else ["ref", "ref", "ref"]
        )
        lines.append(f"| {name} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


PEERS = (
    "torch", "transformers", "torchao", "openvino", "nncf", "gguf", "llama-cpp-python",
    "onnxruntime", "onnx",
)  # fmt: skip


def versions() -> dict[str, str]:
    """Each peer's installed version, or "not installed"."""
    found = {}
    for peer in PEERS:
        try:
            found[peer] = importlib.metadata.version(peer)
        except importlib.metadata.PackageNotFoundError:
            found[peer] = "not installed"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tinyllama")
    for key in CONFIGS["tiny"]:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override {key}")
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128, help="decode run: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode run: new tokens")
    parser.add_argument("--prefill", type=int, default=512, help="prefill run: prompt tokens")
    parser.add_argument("--group-sizes", nargs="*", type=int, default=[128, 32])
    parser.add_argument(
        "--columns",
        nargs="*",
        help="only the columns whose name contains one of these (fp32 torch always runs)",
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        help="llama.cpp's F32 GGUF and OpenVINO's fp32 conversion against torch first "
        f"(default: on below {CHECK_PARAMETERS // 1_000_000}M parameters)",
    )
    parser.add_argument(
        "--openvino-config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="OpenVINO CPU properties for the compiled models, e.g. INFERENCE_PRECISION_HINT=f32 "
        "KV_CACHE_PRECISION=f16 (default: the plugin's, which the output notes)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument(
        "--isa",
        choices=sorted(ISA_CAPS),
        help="cap torch, OpenVINO and quantbridge at this instruction set; under nox, "
        "llama.cpp is built for it too",
    )
    args = parser.parse_args()
    args.openvino_config = dict(kv.split("=", 1) for kv in args.openvino_config)
    shape = dict(CONFIGS[args.config])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)

    def wanted(name: str) -> bool:
        return args.columns is None or any(c.lower() in name.lower() for c in args.columns)

    load = os.getloadavg()
    found = versions()
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, threads {' '.join(map(str, args.threads))}, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in found.items()))
    print(
        f"  quantbridge kernel target {qk.best_target()}"
        + (f"; capped at {args.isa}" if args.isa else "")
    )
    if found["llama-cpp-python"] != "not installed":
        print(f"  llama.cpp: {llama_system_info()}")

    build_threads = max(args.threads)
    torch.set_num_threads(build_threads)
    start = time.perf_counter()
    model = build_model(shape)
    parameters = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    description = (
        f"Llama {shape['layers']} layers, hidden {shape['hidden']}, FFN {shape['intermediate']}, "
        f"{shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']} "
        f"({parameters / 1e6:.1f}M parameters)"
    )
    print(f"\n== {description}: built in {time.perf_counter() - start:.1f} s", flush=True)
    prompt = random_prompt(args.prompt, shape["vocab"], seed=1)
    prefill = random_prompt(args.prefill, shape["vocab"], seed=2)
    with torch.no_grad():
        reference = TorchEngine(model).logits(prefill)

    checks: list[str] = []
    if args.check if args.check is not None else parameters < CHECK_PARAMETERS:
        checks = run_checks(model, prefill[:64], reference[:64])
    suite = build_suite(model, wanted, args.group_sizes, args)
    suite.checks = checks
    with torch.no_grad():
        add_fidelity(suite, prefill, reference, build_threads)

    int4_bytes = int(matrices * 4.5 / 8)  # a Q4_0 copy of the matrices: 4 bits + fp16 per 32
    results: list[dict[str, Any]] = []
    for threads in args.threads:
        bandwidth = stream_bandwidth(int4_bytes, threads)
        print(
            f"\nstreaming read of {_mb(int4_bytes)} on {threads} thread(s): {bandwidth:.1f} GB/s"
            + (
                " (fits in the caches: not the memory's bandwidth)" if int4_bytes < 64 << 20 else ""
            ),
            flush=True,
        )
        results.append(
            time_columns(suite, threads, args.rounds, prompt, prefill, args.new_tokens, bandwidth)
        )
        print_result(results[-1], suite, description, args.new_tokens)
    for note in dict.fromkeys(suite.notes):
        print(f"  note: {note}")
    for check in suite.checks:
        print(f"  check: {check}")
    if results:
        print("\n" + markdown(results, suite))
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "cpu": cpu_model(),
                    "versions": found,
                    "kernel_target": qk.best_target(),
                    "isa": args.isa,
                    "shape": shape,
                    "parameters": parameters,
                    "prompt": args.prompt,
                    "new_tokens": args.new_tokens,
                    "prefill": args.prefill,
                    "int4_stream_bytes": int4_bytes,
                    "columns": {
                        name: {
                            "weight_bytes": c.weight_bytes,
                            "streamed_bytes": c.streamed_bytes,
                            "fidelity": suite.fidelity.get(name),
                        }
                        for name, c in suite.columns.items()
                    },
                    "checks": suite.checks,
                    "notes": suite.notes,
                    "results": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
