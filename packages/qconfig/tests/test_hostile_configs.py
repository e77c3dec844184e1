"""Hostile configuration files: loading refuses each with a QConfigError naming the JSON path,
and nothing they ask for ever runs (a canary file they would create never appears).

Each payload would write the canary if quantbridge called what it names. If loading ever
succeeds, the test still prepares a model with the config and runs a forward pass (where the
call would happen) before failing, so the canary check covers the whole flow.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from quantbridge.qconfig import (
    BackendConfig,
    QConfigError,
    QConfigMapping,
    get_default_qconfig_mapping,
)
from quantbridge.qconfig._json import MAX_DEPTH, MAX_DOCUMENT_CHARS

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(HERE))


class _Exec:
    """Pickles to "exec(code)": what a hostile torch.load / numpy.load file carries."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    return tmp_path / "canary"


def _document(kind: str, data: dict[str, Any]) -> str:
    return json.dumps(
        {"format": "quantbridge.qconfig", "format_version": 1, "type": kind, "data": data}
    )


def _mapping(activation: Any, weight: Any = None) -> str:
    weight = weight or {"$ref": "quantbridge.qconfig.MinMaxObserver"}
    qconfig = {"$qconfig": {"activation": activation, "weight": weight}}
    return _document(
        "QConfigMapping",
        {
            "object_type": [
                {"$tuple": [{"$ref": "torch.nn.ReLU"}, None]},
                {"$tuple": [{"$ref": "torch.nn.Linear"}, None]},
                {"$tuple": [{"$ref": "torch.nn.Conv2d"}, qconfig]},
            ]
        },
    )


def _backend(**fields: Any) -> str:
    config = {
        "pattern": {"$tuple": [{"$ref": "torch.nn.Conv2d"}, {"$ref": "torch.nn.ReLU"}]},
        "fuser_method": {"$ref": "quantbridge.fx_quant._backend_configs._fusers.fuse_conv2d_relu"},
    }
    config.update(fields)
    return _document("BackendConfig", {"name": "hostile", "configs": [config]})


def _with_args(cls: str, **kwargs: Any) -> dict[str, Any]:
    return {"$with_args": {"class": cls, "kwargs": kwargs}}


def _partial(func: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"$partial": {"func": func, "args": list(args), "kwargs": kwargs}}


ACT = "$.object_type[2][1].activation"
WEIGHT = "$.object_type[2][1].weight"
FUSER = "$.configs[0].fuser_method"
REFUSED_CALL = "refusing to call"
MINMAX = "quantbridge.qconfig.MinMaxObserver"
FAKE_QUANT = "quantbridge.qconfig.FakeQuantize"


def hostile_configs(canary: Path, evil_pt: Path, evil_npy: Path) -> list[Any]:
    """(id, kind, document, JSON path the error must start with, text it must contain)."""
    touch = f"open({str(canary)!r}, 'w').write('pwned')"
    shell = f"touch {canary}"
    m, b = "QConfigMapping", "BackendConfig"
    return [
        # code execution through torch
        (
            "exec_with_source",
            m,
            _mapping(_partial("torch.fx.graph_module._exec_with_source", touch, {})),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_load",
            m,
            _mapping(_partial("torch.load", str(evil_pt), weights_only=False)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_load_ref_weight",
            m,
            _mapping(
                {"$ref": "quantbridge.qconfig.MinMaxObserver"},
                _partial("torch.serialization.load", str(evil_pt), weights_only=False),
            ),
            f"{WEIGHT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_hub_load",
            m,
            _mapping(_partial("torch.hub.load", "attacker/repo", "model", trust_repo=True)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "load_inline",
            m,
            _mapping(_partial("torch.utils.cpp_extension.load_inline", "x", f"// {touch}")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_jit_load",
            m,
            _mapping(_partial("torch.jit.load", str(evil_pt))),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "ops_load_library",
            m,
            _mapping(_partial("torch.ops.load_library", str(evil_pt))),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        # builtins reached through torch modules
        (
            "graph_module_exec",
            m,
            _mapping(_partial("torch.fx.graph_module.exec", touch)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "module_builtins",
            m,
            _mapping(_partial("torch.nn.modules.module.__builtins__.exec", touch)),
            f"{ACT}.$partial.func",
            "dunder",
        ),
        (
            "torch_builtins",
            m,
            _mapping(_partial("torch.__builtins__.eval", touch)),
            f"{ACT}.$partial.func",
            "dunder",
        ),
        (
            "qconfig_builtins",
            m,
            _mapping(_partial("quantbridge.qconfig.__builtins__.exec", touch)),
            f"{ACT}.$partial.func",
            "dunder",
        ),
        # os / subprocess reached through torch submodules
        (
            "cpp_extension_subprocess",
            m,
            _mapping(_partial("torch.utils.cpp_extension.subprocess.run", ["touch", str(canary)])),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_os_system",
            m,
            _mapping(_partial("torch.os.system", shell)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "torch_serialization_os",
            m,
            _mapping(_partial("torch.serialization.os.system", shell)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        ("os_system_fuser", b, _backend(fuser_method={"$ref": "os.system"}), FUSER, REFUSED_CALL),
        (
            "subprocess_popen_getter",
            b,
            _backend(root_node_getter={"$ref": "subprocess.Popen"}),
            "$.configs[0].root_node_getter",
            REFUSED_CALL,
        ),
        (
            "quantbridge_reaches_os",
            b,
            _backend(fuser_method={"$ref": "quantbridge.qconfig._json.sys.modules"}),
            FUSER,
            "passes through module 'sys'",
        ),
        # eval / exec / compile / getattr / setattr / __import__ / importlib / pickle / numpy
        (
            "eval",
            m,
            _mapping(_partial("builtins.eval", touch)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "exec",
            m,
            _mapping(_partial("builtins.exec", touch)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        ("compile", b, _backend(fuser_method={"$ref": "builtins.compile"}), FUSER, REFUSED_CALL),
        (
            "getattr",
            b,
            _backend(extra_inputs_getter=_partial("builtins.getattr", "x")),
            "$.configs[0].extra_inputs_getter.$partial.func",
            REFUSED_CALL,
        ),
        (
            "setattr",
            b,
            _backend(fuser_method=_partial("builtins.setattr", "x", "y")),
            f"{FUSER}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "dunder_import",
            m,
            _mapping(_partial("builtins.__import__", "os")),
            f"{ACT}.$partial.func",
            "dunder",
        ),
        (
            "import_module",
            m,
            _mapping(_partial("importlib.import_module", "os")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "pickle_loads",
            m,
            _mapping(_partial("pickle.loads", "x")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "numpy_load",
            m,
            _mapping(_partial("numpy.load", str(evil_npy), allow_pickle=True)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "operator_methodcaller",
            m,
            _mapping(_partial("operator.methodcaller", "system", shell)),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "functools_partial",
            m,
            _mapping(_partial("functools.partial", "os.system")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        # $ref to callables where data is expected
        (
            "ref_as_eps",
            m,
            _mapping(_with_args(MINMAX, eps={"$ref": "torch.load"})),
            f"{ACT}.$with_args.kwargs.eps",
            REFUSED_CALL,
        ),
        (
            "ref_as_dtype",
            m,
            _mapping(_with_args(MINMAX, dtype={"$ref": "os.system"})),
            f"{ACT}.$with_args.kwargs.dtype",
            REFUSED_CALL,
        ),
        (
            "ref_as_observer",
            m,
            _mapping(_with_args(FAKE_QUANT, observer={"$ref": "torch.load"})),
            f"{ACT}.$with_args.kwargs.observer",
            REFUSED_CALL,
        ),
        (
            "ref_in_input_type_to_index",
            b,
            _backend(input_type_to_index={"weight": {"$ref": "builtins.eval"}}),
            "$.configs[0].input_type_to_index.weight",
            REFUSED_CALL,
        ),
        (
            "ref_in_dtype_config",
            b,
            _backend(dtype_configs=[{"input_dtype": {"$ref": "torch.load"}}]),
            "$.configs[0].dtype_configs[0].input_dtype",
            REFUSED_CALL,
        ),
        (
            "partial_as_pattern",
            b,
            _backend(pattern=_partial("torch.load", str(evil_pt))),
            "$.configs[0].pattern.$partial",
            "not a $partial factory",
        ),
        # dunder attribute walks
        (
            "globals_walk",
            m,
            _mapping({"$ref": "quantbridge.qconfig.MinMaxObserver.__init__.__globals__"}),
            ACT,
            "dunder",
        ),
        (
            "subclasses_walk",
            b,
            _backend(pattern={"$ref": "torch.nn.Module.__subclasses__"}),
            "$.configs[0].pattern",
            "dunder",
        ),
        (
            "class_walk",
            b,
            _backend(qat_module={"$ref": "torch.nn.Linear.__class__"}),
            "$.configs[0].qat_module",
            "dunder",
        ),
        # classes whose construction has side effects, where an observer or a module class goes
        (
            "popen_with_args",
            m,
            _mapping(_with_args("subprocess.Popen", args=["touch", str(canary)])),
            f"{ACT}.$with_args.class",
            REFUSED_CALL,
        ),
        (
            "graph_module_with_args",
            m,
            _mapping(_with_args("torch.fx.GraphModule")),
            f"{ACT}.$with_args.class",
            REFUSED_CALL,
        ),
        ("thread_ref", m, _mapping({"$ref": "torch.multiprocessing.Process"}), ACT, REFUSED_CALL),
        (
            "popen_as_fused_module",
            b,
            _backend(fused_module={"$ref": "subprocess.Popen"}),
            "$.configs[0].fused_module",
            "refusing to load 'subprocess.Popen'",
        ),
        (
            "process_as_qat_module",
            b,
            _backend(qat_module={"$ref": "torch.multiprocessing.Process"}),
            "$.configs[0].qat_module",
            "its defining module 'multiprocessing",
        ),
        (
            "graph_module_as_qat_module",
            b,
            _backend(qat_module={"$ref": "torch.fx.GraphModule"}),
            "$.configs[0].qat_module",
            "defined in 'torch.fx",
        ),
        (
            "function_as_module_class",
            b,
            _backend(reference_quantized_module_for_root={"$ref": "torch.load"}),
            "$.configs[0].reference_quantized_module_for_root",
            "not an nn.Module subclass",
        ),
        # registered callables used where they do not belong, quantbridge internals
        (
            "fuser_as_observer",
            m,
            _mapping(_partial("quantbridge.fx_quant._backend_configs._fusers.fuse_conv2d_relu")),
            ACT,
            "does not build an observer",
        ),
        (
            "fuser_as_fake_quant_observer",
            m,
            _mapping(
                _with_args(
                    FAKE_QUANT,
                    observer={"$ref": "quantbridge.fx_quant._fuser_methods.fuse_conv_bn"},
                )
            ),
            f"{ACT}.$with_args.kwargs.observer",
            "fuse_conv_bn does not build an observer",
        ),
        (
            "fuser_as_positional_observer",
            m,
            _mapping(
                _partial(FAKE_QUANT, {"$ref": "quantbridge.fx_quant._fuser_methods.fuse_conv_bn"})
            ),
            f"{ACT}.$partial.args[0]",
            "fuse_conv_bn does not build an observer",
        ),
        (
            "register_itself",
            m,
            _mapping(_partial("quantbridge.qconfig.register_config_callables")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        (
            "quantbridge_internal",
            m,
            _mapping(_partial("quantbridge.qconfig._json._read_source", "/etc/passwd")),
            f"{ACT}.$partial.func",
            REFUSED_CALL,
        ),
        # allowed factories with hostile or broken arguments
        (
            "bogus_kwarg",
            m,
            _mapping(_with_args(MINMAX, bogus_kw=1)),
            f"{ACT}.$with_args.kwargs.bogus_kw",
            "has no argument 'bogus_kw'",
        ),
        (
            "float64_dtype",
            m,
            _mapping(_with_args(MINMAX, dtype={"$dtype": "torch.float64"})),
            ACT,
            "unsupported dtype torch.float64",
        ),
        (
            "nan_averaging_constant",
            m,
            _mapping(
                _with_args(
                    "quantbridge.qconfig.MovingAverageMinMaxObserver",
                    averaging_constant={"$float": "nan"},
                )
            ),
            ACT,
            "averaging_constant must be a number in (0, 1]",
        ),
        (
            "huge_bins",
            m,
            _mapping(_with_args("quantbridge.qconfig.HistogramObserver", bins=10**15)),
            ACT,
            "bins must be an int in [1, 1048576]",
        ),
        (
            "inf_eps",
            m,
            _mapping(_with_args(MINMAX, eps={"$float": "inf"})),
            ACT,
            "eps must be a positive finite float",
        ),
        (
            "string_reduce_range",
            m,
            _mapping(_with_args(MINMAX, reduce_range="no")),
            ACT,
            "reduce_range must be True or False",
        ),
        (
            "dunder_kwarg",
            m,
            _mapping(_with_args(MINMAX, __class__=1)),
            f"{ACT}.$with_args.kwargs.__class__",
            "has no argument",
        ),
        (
            "fake_quant_observer_kwarg",
            m,
            _mapping(_with_args(FAKE_QUANT, averaging_constant=-1)),
            ACT,
            "averaging_constant must be",
        ),
    ]


@pytest.fixture
def corpus(tmp_path: Path, canary: Path) -> list[Any]:
    code = f"open({str(canary)!r}, 'w').write('pwned')"
    evil_pt = tmp_path / "evil.pt"
    evil_pt.write_bytes(pickle.dumps(_Exec(code)))
    evil_npy = tmp_path / "evil.npy"
    np.save(evil_npy, np.array([_Exec(code)], dtype=object), allow_pickle=True)
    return hostile_configs(canary, evil_pt, evil_npy)


def _prepare_and_run(kind: str, loaded: Any) -> None:
    from quantbridge.fx_quant import get_native_backend_config, prepare_fx

    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    if kind == "QConfigMapping":
        prepared = prepare_fx(model, loaded, (x,), backend_config=get_native_backend_config())
    else:
        prepared = prepare_fx(
            model, get_default_qconfig_mapping("x86"), (x,), backend_config=loaded
        )
    prepared(x)


def test_corpus_is_large_and_every_entry_is_distinct(corpus: list[Any]) -> None:
    assert len(corpus) >= 30
    assert len({entry[0] for entry in corpus}) == len(corpus)
    assert len({entry[2] for entry in corpus}) == len(corpus)


def test_every_hostile_config_is_refused_at_load_and_nothing_runs(
    corpus: list[Any], canary: Path
) -> None:
    load = {"QConfigMapping": QConfigMapping.from_json, "BackendConfig": BackendConfig.from_json}
    failures = []
    for name, kind, text, path, reason in corpus:
        try:
            loaded = load[kind](text)
        except QConfigError as e:
            message = str(e)
            if not message.startswith(path + ": ") or reason not in message:
                failures.append(f"{name}: expected '{path}: ...{reason}...', got {message!r}")
        else:
            with contextlib.suppress(Exception):  # where the call would happen: it must not
                _prepare_and_run(kind, loaded)
            failures.append(f"{name}: loaded without error")
        assert not canary.exists(), f"{name}: the payload ran"
    assert not failures, "\n".join(failures)


def test_refusals_say_how_to_allow_a_callable(corpus: list[Any]) -> None:
    text = next(entry[2] for entry in corpus if entry[0] == "torch_load")
    with pytest.raises(QConfigError) as info:
        QConfigMapping.from_json(text)
    assert "register_config_callables" in str(info.value)
    assert "allowed_prefixes" in str(info.value)


def test_the_payloads_would_run_if_called(corpus: list[Any], canary: Path) -> None:
    """The corpus is live: calling what a payload names does write the canary (so the test
    above proves refusal, not a broken payload)."""
    from torch.fx.graph_module import _exec_with_source

    code = f"open({str(canary)!r}, 'w').write('pwned')"
    _exec_with_source(code, {})
    assert canary.exists()
    canary.unlink()
    evil_pt = next(e for e in corpus if e[0] == "torch_load")[2]
    pt_path = json.loads(evil_pt)["data"]["object_type"][2]["$tuple"][1]["$qconfig"]["activation"][
        "$partial"
    ]["args"][0]
    with contextlib.suppress(Exception):  # no checkpoint, but the unpickling already ran
        torch.load(pt_path, weights_only=False)
    assert canary.exists()


# -- limits ---------------------------------------------------------------------------------------


def test_100000_nested_arrays_are_refused_without_recursion() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    text = _document("QConfigMapping", {}).replace('"data": {}', f'"data": {{"x": {deep}}}')
    with pytest.raises(QConfigError, match=rf"^\$\.x(\[0\]){{{MAX_DEPTH - 2}}}: nesting deeper"):
        QConfigMapping.from_json(text)


@pytest.mark.parametrize("depth", [400, 600])
def test_deeply_nested_tuples_are_refused_with_their_path(depth: int) -> None:
    nested = '{"$tuple": [' * depth + "]}" * depth
    text = _document("QConfigMapping", {}).replace(
        '"data": {}', f'"data": {{"object_type": [{nested}]}}'
    )
    with pytest.raises(QConfigError, match=r"^\$\.object_type\[0\](\[0\])+: nesting deeper than"):
        QConfigMapping.from_json(text)


def test_nesting_at_the_limit_loads_and_one_more_level_does_not() -> None:
    def text(levels: int) -> str:  # data is level 2 (document, data): levels - 2 more arrays
        inner = "[" * (levels - 2) + "]" * (levels - 2)
        return _document("DTypeConfig", {}).replace('"data": {}', f'"data": {{"x": {inner}}}')

    from quantbridge.qconfig import DTypeConfig

    # Unknown key 'x' is the from_dict error: the document itself parsed.
    with pytest.raises(QConfigError, match="unknown key"):
        DTypeConfig.from_json(text(MAX_DEPTH))
    with pytest.raises(QConfigError, match="nesting deeper than"):
        DTypeConfig.from_json(text(MAX_DEPTH + 1))


def test_long_dotted_names_are_refused_with_their_path() -> None:
    name = ".".join(["torch"] + ["nn"] * 500)
    with pytest.raises(QConfigError, match=rf"^{_re(ACT)}: the name .* is too long"):
        QConfigMapping.from_json(_mapping({"$ref": name}))
    with pytest.raises(QConfigError, match=r"^\$\.configs\[0\]\.pattern: the name .* too long"):
        BackendConfig.from_json(_backend(pattern={"$ref": "torch." + "x" * 300}))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_bare_non_finite_literals_are_refused(literal: str) -> None:
    text = _mapping(_with_args(MINMAX, eps=0.5)).replace('"eps": 0.5', f'"eps": {literal}')
    with pytest.raises(
        QConfigError, match=rf"^{_re(ACT)}\.\$with_args\.kwargs\.eps: '{literal}' is not allowed"
    ):
        QConfigMapping.from_json(text)


def test_numbers_beyond_the_limits_are_refused() -> None:
    text = _mapping(_with_args(MINMAX, eps=0.5)).replace('"eps": 0.5', '"eps": 1e999')
    with pytest.raises(QConfigError, match=r"kwargs\.eps: '1e999' is not allowed.*overflows"):
        QConfigMapping.from_json(text)
    text = _mapping(_with_args(MINMAX, quant_min=0)).replace(
        '"quant_min": 0', '"quant_min": ' + "9" * 5000
    )
    with pytest.raises(QConfigError, match=r"kwargs\.quant_min: .* at most 20 digits"):
        QConfigMapping.from_json(text)


def test_document_size_is_limited(tmp_path: Path) -> None:
    big = _document("QConfigMapping", {"module_name": [], "pad": "x" * MAX_DOCUMENT_CHARS})
    with pytest.raises(QConfigError, match=rf"larger than {MAX_DOCUMENT_CHARS} characters"):
        QConfigMapping.from_json(big)
    path = tmp_path / "big.json"
    path.write_text(big)
    with pytest.raises(QConfigError, match=rf"larger than {MAX_DOCUMENT_CHARS} characters"):
        QConfigMapping.from_json(path)
    with open(path) as f, pytest.raises(QConfigError, match="larger than"):
        QConfigMapping.from_json(f)


def _re(text: str) -> str:
    import re

    return re.escape(text)


# -- load-time validation of factories ------------------------------------------------------------


def test_valid_factories_still_load_and_build() -> None:
    activation = _with_args(
        FAKE_QUANT,
        observer=_with_args(
            "quantbridge.qconfig.MovingAverageMinMaxObserver", averaging_constant=0.5
        ),
        quant_min=0,
        quant_max=127,
    )
    mapping = QConfigMapping.from_json(_mapping(activation))
    qconfig = mapping.object_type_qconfigs[nn.Conv2d]
    assert qconfig is not None
    fq = qconfig.activation()
    assert fq.activation_post_process.averaging_constant == 0.5
    assert (fq.quant_min, fq.quant_max) == (0, 127)


@pytest.mark.parametrize(
    ("averaging_constant", "ok"),
    [
        (1, True),
        (0.5, True),
        (1e-9, True),
        (0, False),
        (-0.1, False),
        (1.5, False),
        (math.inf, False),
        (math.nan, False),
        (True, False),
        ("0.5", False),
    ],
)
def test_averaging_constant_is_checked_by_the_observers(averaging_constant: Any, ok: bool) -> None:
    from quantbridge.qconfig import (
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
    )

    for cls in (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver):
        if ok:
            assert (
                cls(averaging_constant=averaging_constant).averaging_constant == averaging_constant
            )
        else:
            with pytest.raises(QConfigError, match=rf"^{cls.__name__}: averaging_constant must"):
                cls(averaging_constant=averaging_constant)


def test_json_paths_name_the_failing_factory_in_the_global_entry() -> None:
    text = _document(
        "QConfigMapping",
        {"": {"$qconfig": {"activation": _with_args(MINMAX, bogus_kw=1), "weight": None}}},
    )
    with pytest.raises(
        QConfigError,
        match=r'^\$\[""\]\.activation\.\$with_args\.kwargs\.bogus_kw: MinMaxObserver has no '
        r"argument 'bogus_kw'; it accepts dtype, eps, ",
    ):
        QConfigMapping.from_json(text)


# -- allowed_prefixes and the registry ------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    ["torch", "torch.fx", "os", "builtins", "subprocess", "numpy", "pickle", "quantbridge"],
)
def test_prefixes_cannot_admit_the_protected_roots(prefix: str) -> None:
    with pytest.raises(QConfigError, match=rf"allowed_prefixes: '{prefix}' lies under"):
        QConfigMapping.from_json(_mapping(None), allowed_prefixes=(prefix,))


def test_a_callers_prefix_admits_only_what_its_modules_define() -> None:
    helpers = "config_backend_helpers"
    # the caller's own function: admitted
    loaded = BackendConfig.from_json(
        _backend(fuser_method={"$ref": f"{helpers}.fuse_conv2d_relu"}), allowed_prefixes=(helpers,)
    )
    assert loaded.configs[0].fuser_method.__module__ == helpers  # type: ignore[union-attr]
    # what the module imported from elsewhere: refused (torch, sys, Path, ...)
    for name, reason in [
        (f"{helpers}.torch.load", "passes through module 'torch'"),
        (f"{helpers}.sys.modules", "passes through module 'sys'"),
        (f"{helpers}.Path", "defined in 'pathlib'"),
    ]:
        with pytest.raises(QConfigError, match=rf"^\$\.configs\[0\]\.fuser_method: .*{reason}"):
            BackendConfig.from_json(
                _backend(fuser_method={"$ref": name}), allowed_prefixes=(helpers,)
            )


def test_register_config_callables_refuses_dangerous_and_unnamed_objects() -> None:
    from quantbridge.qconfig import register_config_callables

    for obj, reason in [
        (torch.load, "defined in 'torch'"),
        (eval, "not a plain function or class"),
        (json.loads, "defined in 'json'"),
        (lambda: None, "no importable name"),
        (json, "not a function or class"),
        (1, "not a function or class"),
    ]:
        with pytest.raises(QConfigError, match=rf"^register_config_callables: .*{reason}"):
            register_config_callables(obj)  # type: ignore[arg-type]


def test_registering_a_function_lets_files_call_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "qb_hostile_plugin.py").write_text(
        "import os\n\ndef fuse(is_qat, conv, relu):\n    return conv\n\n"
        "def other(is_qat, conv, relu):\n    return relu\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    text = _backend(fuser_method={"$ref": "qb_hostile_plugin.fuse"})
    with pytest.raises(QConfigError, match=REFUSED_CALL):  # not imported: nothing is imported
        BackendConfig.from_json(text)
    assert "qb_hostile_plugin" not in sys.modules
    import qb_hostile_plugin  # type: ignore[import-not-found]

    with pytest.raises(QConfigError, match="is not registered"):
        BackendConfig.from_json(text)
    from quantbridge.qconfig import register_config_callables

    register_config_callables(qb_hostile_plugin.fuse)
    loaded = BackendConfig.from_json(text)
    assert loaded.configs[0].fuser_method is qb_hostile_plugin.fuse
    # its unregistered neighbours and what it imports stay refused
    for name, reason in [
        ("qb_hostile_plugin.other", "is not registered"),
        ("qb_hostile_plugin.os.system", "passes through module 'os'"),
    ]:
        with pytest.raises(QConfigError, match=reason):
            BackendConfig.from_json(_backend(fuser_method={"$ref": name}))


# -- random documents -----------------------------------------------------------------------------

_TAGS = [
    "$ref",
    "$tuple",
    "$dict",
    "$float",
    "$dtype",
    "$qscheme",
    "$observation_type",
    "$dtype_with_constraints",
    "$qconfig",
    "$with_args",
    "$partial",
    "$bogus",
]
_NAMES = [
    "torch.load",
    "os.system",
    "quantbridge.qconfig.MinMaxObserver",
    "torch.nn.Linear",
    "quantbridge.qconfig.FakeQuantize",
    "operator.add",
    "torch.ops.aten.relu.default",
    "quantbridge.qconfig.HistogramObserver",
    "torch.nn.Module.__subclasses__",
    "a..b",
    "",
]
_KEYS = [
    "",
    "object_type",
    "module_name",
    "module_name_regex",
    "module_name_object_type_order",
    "configs",
    "pattern",
    "fuser_method",
    "activation",
    "weight",
    "class",
    "kwargs",
    "func",
    "args",
    "dtype",
    "eps",
    "averaging_constant",
    "bins",
    "name",
    "qat_module",
]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(_NAMES)
    | st.text(max_size=30)
)


def _trees() -> st.SearchStrategy[Any]:
    return st.recursive(
        _scalars,
        lambda children: (
            st.lists(children, max_size=5)
            | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), children, max_size=5)
            | st.builds(lambda tag, body: {tag: body}, st.sampled_from(_TAGS), children)
        ),
        max_leaves=40,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        ["QConfigMapping", "BackendConfig", "BackendPatternConfig", "DTypeConfig"]
    ),
    data=_trees(),
    depth=st.integers(min_value=0, max_value=3 * MAX_DEPTH),
)
def test_random_documents_load_or_raise_qconfig_error(kind: str, data: Any, depth: int) -> None:
    from quantbridge.qconfig import BackendPatternConfig, DTypeConfig

    cls: Any = {
        "QConfigMapping": QConfigMapping,
        "BackendConfig": BackendConfig,
        "BackendPatternConfig": BackendPatternConfig,
        "DTypeConfig": DTypeConfig,
    }[kind]
    if isinstance(data, dict) and depth % 2:  # sometimes bury it deep
        data = {"object_type": [json.loads("[" * depth + "1" + "]" * depth)] if depth < 400 else []}
    text = _document(kind, data) if isinstance(data, dict) else _document(kind, {"configs": data})
    with contextlib.suppress(QConfigError):  # any other exception fails the test
        cls.from_json(text)


_JSONISH = st.text(alphabet='[]{}",:0123456789eE.-+ \\ntruefalsNIiny$', max_size=200)


@settings(max_examples=300, deadline=None)
@given(body=_JSONISH, deep=st.integers(min_value=0, max_value=2000))
def test_random_text_loads_or_raises_qconfig_error(body: str, deep: int) -> None:
    """Broken, deep, NaN-laden JSON text: QConfigError or a config, never another error."""
    text = (
        '{"format": "quantbridge.qconfig", "format_version": 1, "type": "QConfigMapping", '
        f'"data": {{"object_type": {"[" * deep}{body}{"]" * deep}}}}}'
    )
    with contextlib.suppress(QConfigError):
        QConfigMapping.from_json(text)


def test_patterns_and_module_classes_are_data_and_never_called(
    tmp_path: Path, canary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patterns and module classes are only compared with the model's nodes and modules: a
    function or class that would write the canary when called or built never is."""
    from quantbridge.fx_quant import prepare_fx

    (tmp_path / "qb_pattern_canary.py").write_text(
        "from torch import nn\n"
        f"def touch(*args, **kwargs):\n    open({str(canary)!r}, 'w').write('pwned')\n"
        "class Boom(nn.Module):\n"
        "    def __init__(self, *args, **kwargs):\n        touch()\n"
        "    @classmethod\n    def from_float(cls, *args, **kwargs):\n        touch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    conv, boom = {"$ref": "torch.nn.Conv2d"}, {"$ref": "qb_pattern_canary.Boom"}
    text = _document(
        "BackendConfig",
        {
            "name": "patterns",
            "configs": [
                {"pattern": {"$ref": "qb_pattern_canary.touch"}},
                {"pattern": boom, "root_module": boom, "qat_module": boom},
                {"pattern": {"$tuple": [conv, {"$ref": "qb_pattern_canary.touch"}]}},
                {"pattern": {"$ref": "torch.load"}, "fused_module": boom},
            ],
        },
    )
    loaded = BackendConfig.from_json(text, allowed_prefixes=("qb_pattern_canary",))
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    mapping = get_default_qconfig_mapping("x86")
    prepare_fx(model, mapping, (x,), backend_config=loaded)(x)
    assert not canary.exists()


_CLASSES = [
    "quantbridge.qconfig." + n
    for n in (
        "MinMaxObserver",
        "MovingAverageMinMaxObserver",
        "PerChannelMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
        "HistogramObserver",
        "PlaceholderObserver",
        "FixedQParamsObserver",
        "NoopObserver",
        "ReuseInputObserver",
        "FakeQuantize",
        "FixedQParamsFakeQuantize",
        "FusedMovingAvgObsFakeQuantize",
    )
]
_ARGS = ["dtype", "qscheme", "reduce_range", "quant_min", "quant_max", "eps", "is_dynamic",
         "averaging_constant", "ch_axis", "bins", "scale", "zero_point", "observer",
         "factory_kwargs", "custom_op_name", "compute_dtype"]  # fmt: skip
_VALUES = (
    _scalars
    | st.sampled_from(
        [
            {"$float": "nan"},
            {"$float": "inf"},
            {"$float": "-inf"},
            {"$dtype": "torch.float64"},
            {"$dtype": "torch.int8"},
            {"$dtype": "torch.quint8"},
            {"$qscheme": "per_channel_symmetric"},
            {"$qscheme": "per_tensor_affine"},
            {"$ref": "quantbridge.qconfig.MinMaxObserver"},
            {"$ref": "quantbridge.qconfig.default_observer"},
            {"device": "meta"},
        ]
    )
    | st.integers(min_value=-(2**70), max_value=2**70)
)
_FACTORIES = st.recursive(
    st.builds(
        lambda cls, kwargs: {"$with_args": {"class": cls, "kwargs": kwargs}},
        st.sampled_from(_CLASSES),
        st.dictionaries(st.sampled_from(_ARGS), _VALUES, max_size=4),
    ),
    lambda inner: st.builds(
        lambda cls, obs, kwargs: {
            "$with_args": {"class": cls, "kwargs": {"observer": obs, **kwargs}}
        },
        st.sampled_from(_CLASSES[-3:]),
        inner,
        st.dictionaries(st.sampled_from(_ARGS), _VALUES, max_size=3),
    ),
    max_leaves=3,
)


@settings(max_examples=300, deadline=None)
@given(activation=_FACTORIES | st.none(), weight=_FACTORIES | st.none())
def test_random_factories_load_or_raise_qconfig_error(activation: Any, weight: Any) -> None:
    """Observer factories with random arguments: checked while loading (a QConfigError with
    the path), and whatever loads builds its observers."""
    text = _document(
        "QConfigMapping", {"": {"$qconfig": {"activation": activation, "weight": weight}}}
    )
    error: QConfigError | None = None
    try:
        mapping = QConfigMapping.from_json(text)
    except QConfigError as e:
        error = e
    if error is not None:
        assert str(error).startswith(('$[""]', "from_json")), str(error)
        return
    qconfig = mapping.global_qconfig
    assert qconfig is not None
    for ctor in (qconfig.activation, qconfig.weight):
        if ctor is not None:
            ctor()  # loading promised these arguments build
