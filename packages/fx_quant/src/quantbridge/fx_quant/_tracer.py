"""The quantization tracer: torch.fx symbolic tracing with the flow's leaf-module rules.

A module is traced through (its ``forward`` inlined) unless it is a leaf: torch.nn's own
layers (but not ``nn.Sequential``), the flow's fused/QAT/reference modules (but not the
traceable transformer modules of ``nn.quantizable``), modules whose
qualified name or class the caller asks to skip (non-traceable, standalone and custom
modules). For every node the tracer records the scope it was created in: the qualified name
and class of the module whose ``forward`` made the call (``("", None)`` at the root).
"""

from __future__ import annotations

import linecache
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.fx import GraphModule, Tracer

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.intrinsic import FusedModule
from quantbridge.fx_quant.nn.quantizable import TRACED_THROUGH

__all__ = ["QuantizationTracer", "TraceError", "trace"]

_OWN_MODULE_PREFIX = "quantbridge.fx_quant.nn"


class TraceError(FxQuantError):
    """The model cannot be symbolically traced."""


def _is_foreign_fused(m: nn.Module) -> bool:
    return any(c.__name__ == "_FusedModule" for c in type(m).__mro__)


def _is_flow_module(m: nn.Module) -> bool:
    mod = type(m).__module__
    return mod.startswith(("torch.nn", "torch.ao.nn", _OWN_MODULE_PREFIX))


class QuantizationTracer(Tracer):
    """``torch.fx.Tracer`` with torch.ao's quantization leaf rules.

    Args:
        skipped_module_names: qualified names of modules kept as leaves (not traced into).
        skipped_module_classes: module classes kept as leaves.

    After :meth:`trace`, ``node_name_to_scope`` maps each node name to
    ``(module_path, module_type)`` of the module whose ``forward`` created it (for a module
    call: the called module itself).
    """

    def __init__(
        self,
        skipped_module_names: Sequence[str] = (),
        skipped_module_classes: Sequence[Callable[..., Any]] = (),
    ) -> None:
        super().__init__()
        self.skipped_module_names = list(skipped_module_names)
        self.skipped_module_classes = list(skipped_module_classes)
        self._skipped_names = set(self.skipped_module_names)
        self._skipped_classes = tuple(c for c in self.skipped_module_classes if isinstance(c, type))
        # Node stack traces cost a third of tracing time and nothing here reads them.
        self.record_stack_traces = False
        # Qualified name of the module whose forward is being traced (innermost last).
        self._module_path_stack: list[str] = []
        self.failed_module_path: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._skipped_names:
            return True
        if type(m) in self.skipped_module_classes:
            return True
        if isinstance(m, FusedModule) or _is_foreign_fused(m):
            return True  # fused units are Sequentials, but they are leaves
        if type(m) in TRACED_THROUGH:
            return False  # the traceable transformer modules prepare swaps in
        return _is_flow_module(m) and not isinstance(m, nn.Sequential)

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        name = self.path_of_module(m)
        self._module_path_stack.append(name)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module_path is None:
                self.failed_module_path = name  # innermost module first
            raise
        finally:
            self._module_path_stack.pop()


# The standard library's own frames (inspect, functools, ...) are never the model's line.
_STDLIB = sysconfig.get_paths()["stdlib"].replace("\\", "/")


def user_frame(tb: Any) -> str:
    """The innermost traceback frame outside torch, quantbridge and the standard library:
    the model's line."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        fname = frame.filename.replace("\\", "/")
        if "/torch/" in fname or ("/quantbridge/" in fname and "/tests/" not in fname):
            continue
        if fname.startswith(_STDLIB + "/") and "/site-packages/" not in fname:
            continue
        line = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {line}'
    return "(no user frame found)"


def _failing_module(path: str | None, root: nn.Module) -> str:
    if path:
        return f"submodule {path!r} ({type(root.get_submodule(path)).__name__})"
    return f"the root module ({type(root).__name__})"


def trace(
    model: nn.Module,
    skipped_module_names: Sequence[str] = (),
    skipped_module_classes: Sequence[Callable[..., Any]] = (),
) -> tuple[GraphModule, dict[str, tuple[str, Any]]]:
    """Symbolically trace ``model``; return the GraphModule and ``node_name_to_scope``.

    Raises TraceError naming the module being traced and the model's source line when
    tracing fails, with the usual fix (mark the module non-traceable).
    """
    if not isinstance(model, nn.Module):
        raise FxQuantError(
            f"expected an nn.Module to quantize, got {type(model).__name__}; pass the model "
            "instance"
        )
    tracer = QuantizationTracer(skipped_module_names, skipped_module_classes)
    try:
        graph = tracer.trace(model)
    except FxQuantError:
        raise
    except Exception as e:  # tracing runs arbitrary user code
        path = tracer.failed_module_path
        export = (
            "capture it with torch.export instead: prepare_fx(..., capture='export') "
            "quantizes the model unmodified"
        )
        if path:
            hint = (
                f"{export}; or keep it out of tracing (it then stays float) with "
                f"PrepareCustomConfig().set_non_traceable_module_names([{path!r}]), or make "
                "its forward traceable"
            )
        else:
            hint = (
                f"{export}; or move the data-dependent code into a submodule and list it in "
                "PrepareCustomConfig().set_non_traceable_module_names([...]), or make "
                "forward traceable"
            )
        raise TraceError(
            f"cannot trace the model symbolically: {type(e).__name__}: {e}\n"
            f"  while tracing {_failing_module(path, model)}\n"
            f"  at {user_frame(e.__traceback__)}\n"
            f"  fix: {hint}"
        ) from e
    for node in graph.nodes:
        # ``from __future__ import annotations`` makes forward's annotations strings; fx
        # records them as a global named after the string, which torch.save cannot pickle
        if isinstance(node.type, str):
            node.type = None
    gm = GraphModule(tracer.root, graph, type(model).__name__)
    scope = {k: (v[0], v[1]) for k, v in tracer.node_name_to_scope.items()}
    return gm, scope
