"""A lowered model passes numpy arrays between its kernel modules, with the generated
forward's numbers, and falls back to the generated forward where it must."""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch.fx import GraphModule

if str(Path(__file__).parent) not in sys.path:  # helpers, under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parent))
import lowering_zoo as zoo

import quantbridge.lowering as L
from quantbridge import kernels as K
from quantbridge.fx_quant import calibrate, prepare_fx
from quantbridge.lowering import LoweredModule, LoweringError, use_array_forward
from quantbridge.lowering._array_forward import ArrayForward
from quantbridge.lowering._modules import QuantizedConv

NUMBA = [f"numba_{t}" for t in K.available_targets()]


def _lowered(case: zoo.Case, backend_name: str = "numba_generic") -> GraphModule:
    backend = L.get_backend(backend_name)
    return backend.lower(zoo.reference_model(case, backend))


def _generated(gm: GraphModule, *args: torch.Tensor) -> object:
    return type(gm).forward(gm, *args)


def _same(a: object, b: object) -> None:
    if isinstance(a, (tuple, list)):
        assert isinstance(b, type(a))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
        return
    assert isinstance(a, torch.Tensor)
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", zoo.ALL_CASES, ids=lambda c: c.name)
def test_every_zoo_model_gives_the_generated_forwards_outputs(case: zoo.Case):
    gm = _lowered(case)
    kernels = any(isinstance(m, LoweredModule) and m.array_input for m in gm.modules())
    assert isinstance(gm.forward, ArrayForward) == kernels
    with torch.no_grad():
        for seed in (1, 2):
            x = case.inputs(seed)
            _same(gm(*x), _generated(gm, *x))


@pytest.mark.parametrize("backend_name", NUMBA)
@pytest.mark.parametrize("name", ["residual_add_mul", "depthwise", "pools", "conv_bn_cnn"])
def test_cnns_on_every_target_match_and_skip_the_module_calls(
    name: str, backend_name: str, monkeypatch: pytest.MonkeyPatch
):
    case = {c.name: c for c in zoo.STATIC_CASES}[name]
    gm = _lowered(case, backend_name)
    x = case.inputs(3)
    with torch.no_grad():
        want = _generated(gm, *x)

        def refuse(self: object, *args: object) -> None:
            raise AssertionError("a kernel module ran as a torch module")

        for mod in gm.modules():
            if isinstance(mod, LoweredModule) and mod.array_input:
                monkeypatch.setattr(type(mod), "forward", refuse)
        _same(gm(*x), want)


def _conv_model() -> tuple[GraphModule, tuple[torch.Tensor, ...]]:
    case = {c.name: c for c in zoo.STATIC_CASES}["conv_bn_cnn"]
    return _lowered(case), case.inputs(4)


def test_a_forward_hook_sees_its_call_and_can_change_the_output():
    gm, x = _conv_model()
    conv = next(m for m in gm.modules() if isinstance(m, QuantizedConv))
    with torch.no_grad():
        want = gm(*x)
        seen: list[torch.Tensor] = []
        handle = conv.register_forward_hook(lambda m, i, o: seen.append(o))
        _same(gm(*x), want)
        assert len(seen) == 1
        handle.remove()
        # a hook that changes the output: the model must use what it returns
        handle = conv.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
        changed = gm(*x)
        handle.remove()
        assert not torch.equal(changed, want)
        _same(changed, _generated_with_hook(gm, conv, x))


def _generated_with_hook(gm: GraphModule, conv: torch.nn.Module, x: tuple) -> object:
    handle = conv.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        return _generated(gm, *x)
    finally:
        handle.remove()


def test_deepcopy_keeps_it_and_use_array_forward_puts_it_back():
    gm, x = _conv_model()
    with torch.no_grad():
        want = gm(*x)
        copied = copy.deepcopy(gm)
        assert isinstance(copied.forward, ArrayForward)
        _same(copied(*x), want)
        del gm  # the copy's forward holds its own model
        _same(copied(*x), want)
        # a pickled forward holds nothing (its model is not in the pickle)
        assert not isinstance(pickle.loads(pickle.dumps(copied.forward)), ArrayForward)
        del copied.forward  # the generated forward again, as after loading a pickle
        _same(copied(*x), want)
        assert use_array_forward(copied) is copied
        assert isinstance(copied.forward, ArrayForward)
        _same(copied(*x), want)


class _Unannotated(torch.nn.Module):
    # no annotations: torch.fx would keep string annotations, which pickle refuses
    def __init__(self):  # type: ignore[no-untyped-def]
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.relu = torch.nn.ReLU()
        self.head = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.head(self.relu(self.conv(x))) + 1.0


def test_a_pickled_model_loads_with_the_generated_forward_until_asked():
    backend = L.get_backend("numba_generic")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 10)
    prepared = prepare_fx(_Unannotated().eval(), backend.qconfig_mapping(), (x,),
                          backend_config=backend.backend_config)  # fmt: skip
    calibrate(prepared, [(torch.randn(2, 3, 10, 10),) for _ in range(3)], progress=False)
    gm = backend.convert(prepared)
    assert isinstance(gm.forward, ArrayForward)
    with torch.no_grad():
        want = gm(x)
        loaded = pickle.loads(pickle.dumps(gm))
        assert not isinstance(loaded.__dict__.get("forward"), ArrayForward)
        _same(loaded(x), want)
        assert isinstance(use_array_forward(loaded).forward, ArrayForward)
        _same(loaded(x), want)


def test_a_recompiled_graph_runs_its_new_nodes():
    gm, x = _conv_model()
    with torch.no_grad():
        before = gm(*x)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.mul, (output.args[0], 2.0))
        output.args = (doubled,)
        gm.recompile()
        _same(gm(*x), before * 2.0)


def test_keyword_arguments_and_tracing_use_the_generated_forward():
    gm, x = _conv_model()
    with torch.no_grad():
        want = gm(*x)
        name = next(n.target for n in gm.graph.nodes if n.op == "placeholder")
        _same(gm(**{str(name): x[0]}), want)
        exported = torch.export.export(gm, x)
        _same(exported.module()(*x), want)


def test_use_array_forward_refuses_what_is_not_a_graph_module():
    with pytest.raises(LoweringError, match="use_array_forward: expected a lowered GraphModule"):
        use_array_forward(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_a_conv_modules_prepared_call_follows_its_state():
    # a conv module keeps its kernels.PreparedConv between calls; a change of relu, of its
    # qparams (load_state_dict) or of the input layout must give what kernels.conv2d gives
    gm, x = _conv_model()
    conv = next(m for m in gm.modules() if isinstance(m, QuantizedConv))
    codes = torch.randint(0, 256, (2, conv.weight.shape[1], 9, 9), dtype=torch.uint8)

    def direct(inp: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(K.conv2d(
            inp.numpy(), conv._packed, *conv.input_qparams, *conv.conv_qparams,
            relu=conv.relu, channels_last=True, lut=conv._act_table,
        ))  # fmt: skip

    with torch.no_grad():
        _same(conv(codes), direct(codes))
        assert conv._prepared is not None
        state = conv.state_dict()
        state["input_zero_point"] = state["input_zero_point"] + 7
        state["zero_point"] = torch.full_like(state["zero_point"], 100)  # relu clamps at it
        conv.load_state_dict(state)
        before = conv(codes)
        _same(before, direct(codes))
        conv.relu = not conv.relu
        after = conv(codes)
        _same(after, direct(codes))
        assert not torch.equal(before, after)
        channels_last = codes.contiguous(memory_format=torch.channels_last)
        _same(conv(channels_last), direct(channels_last))
        _same(gm(*x), _generated(gm, *x))


class _Shapes(torch.nn.Module):
    """Arguments of every kind the compiled forward must rebuild: lists holding values,
    keyword arguments, slices, a method on a computed size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4 + 4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.conv(x))
        part = y[:, 2:6]  # a slice of channels
        flat = torch.cat([y.reshape(y.size(0), -1), part.flatten(start_dim=1)], dim=1)
        return self.fc(flat), part.transpose(2, 3)


def test_the_compiled_steps_equal_the_step_loop_and_the_generated_forward():
    backend = L.get_backend("numba")
    model = _Shapes().eval()
    x = (torch.randn(2, 3, 4, 4),)
    prepared = prepare_fx(
        model, backend.qconfig_mapping(), x, backend_config=backend.backend_config
    )
    calibrate(prepared, [(torch.randn(2, 3, 4, 4),) for _ in range(3)], progress=False)
    gm = backend.convert(prepared)
    assert isinstance(gm.forward, ArrayForward)
    with torch.no_grad():
        got = gm(*x)
        plan = gm.forward._plan
        assert plan is not None
        _same(got, _generated(gm, *x))
        _same(got, plan.run_steps(gm, x))
        # a new batch size flows through the sizes the steps compute (y.size(0))
        x3 = (torch.randn(3, 3, 4, 4),)
        _same(gm(*x3), _generated(gm, *x3))
        _same(gm(*x3), plan.run_steps(gm, x3))


_SHAPE_CASES = [
    ("reshape", (2, -1, 4)),
    ("reshape", ((6, 4),)),
    ("reshape", (5, -1)),  # no such shape: torch's error
    ("view", (3, 8)),
    ("transpose", (1, 2)),
    ("transpose", (-1, 0)),
    ("transpose", (-3, -2)),
    ("transpose", (0, 3)),  # out of range: torch's error
    ("transpose", (-4, 1)),
    ("transpose", (1,)),
    ("transpose", (1.0, 2)),  # not ints: torch's error
    ("permute", (2, 0, 1)),
    ("unsqueeze", (-1,)),
    ("contiguous", ()),
]


@pytest.mark.parametrize(("name", "args"), _SHAPE_CASES)
def test_shape_methods_on_arrays_are_torch_methods(name: str, args: tuple[object, ...]):
    # the steps between kernel modules run shape methods on numpy views: each must give
    # torch's values, shape and strides, or the error torch gives
    from quantbridge.lowering._array_forward import _SHAPE_METHODS

    array = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4).numpy().swapaxes(0, 0)
    tensor = torch.from_numpy(array)
    try:
        want = getattr(tensor, name)(*args)
    except (RuntimeError, TypeError, IndexError) as e:
        with pytest.raises(type(e)):
            _SHAPE_METHODS[name](array, *args)
        return
    got = _SHAPE_METHODS[name](array, *args)
    got_t = torch.from_numpy(got) if not isinstance(got, torch.Tensor) else got
    assert got_t.shape == want.shape
    assert got_t.stride() == want.stride()
    assert torch.equal(got_t, want)
