"""ARCHITECTURE.md rules 1 and 2, checked by reading every import and attribute in runtime code.

Rule 1: imports only go down the layers; kernels imports neither torch nor a sibling.
Rule 2: runtime code never imports torch.ao and never touches quantized tensor types or ops,
except the torch_native comparison backend, isolated in one module of lowering.
No package imports another package's private (``_``-prefixed) modules, in its code or tests.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("patterns", "qconfig", "kernels", "fx_quant", "lowering")

# Which siblings each package may import (the layer diagram of ARCHITECTURE.md).
ALLOWED_SIBLINGS: dict[str, set[str]] = {
    "patterns": set(),
    "qconfig": {"patterns"},
    "kernels": set(),
    "fx_quant": {"qconfig", "patterns"},
    "lowering": {"fx_quant", "qconfig", "patterns", "kernels"},
}
# Modules allowed to use torch's quantized engine: comparison baselines, never on a
# quantbridge runtime path. The torch_native backend is rule 2's named exception. (The kernels
# bench, which times torch's engine beside ours, is a script outside the package:
# packages/kernels/bench/bench_kernels.py, not runtime code.)
COMPARISON_BASELINE_MODULES = ("quantbridge/lowering/_torch_native.py",)

FORBIDDEN_ATTRIBUTES = (
    "torch.ao",
    "torch.quint8",
    "torch.qint8",
    "torch.qint32",
    "torch.quint4x2",
    "torch.quint2x4",
    "torch.quantize_per_tensor",
    "torch.quantize_per_channel",
    "torch.quantize_per_tensor_dynamic",
    "torch._make_per_tensor_quantized_tensor",
    "torch._make_per_channel_quantized_tensor",
    "torch.ops.quantized",
    "torch.nn.quantized",
    "torch.backends.quantized",
    "torch.per_tensor_affine",  # qscheme objects belong to quantized tensors; use strings
)


def _runtime_files(package: str) -> list[Path]:
    return sorted((ROOT / "packages" / package / "src").rglob("*.py"))


def _test_files(package: str) -> list[Path]:
    return sorted((ROOT / "packages" / package / "tests").rglob("*.py"))


# A package's tests may import their own package's private modules, never a sibling's; the
# only exception is a white-box test that monkeypatches a sibling's internals (a public
# name cannot be patched where the kernels look it up).
TEST_PRIVATE_IMPORT_EXCEPTIONS: dict[str, set[str]] = {
    # lowering's thread tests spy on the kernels' thread swap to see each call's count.
    "packages/lowering/tests/test_lowering_threads.py": {"quantbridge.kernels._threads"},
}


def _private_sibling_imports(
    tree: ast.AST, module_name: str, package: str
) -> list[tuple[int, str]]:
    """Imports of another quantbridge package's ``_private`` module or name, in any form."""
    found = []
    for lineno, name in _imports(tree, module_name):
        parts = name.split(".")
        if parts[0] != "quantbridge" or len(parts) < 3 or parts[1] == package:
            continue
        if any(p.startswith("_") and not p.endswith("__") for p in parts[2:]):
            found.append((lineno, name))
    return found


def _imports(tree: ast.AST, module_name: str) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the module's package
                base = module_name.rsplit(".", node.level)[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _dynamic_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Modules named by a literal in ``import_module(...)`` or ``__import__(...)`` calls."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = _dotted(node.func) or ""
            first = node.args[0]
            if func.rsplit(".", 1)[-1] in ("import_module", "__import__") and (
                isinstance(first, ast.Constant) and isinstance(first.value, str)
            ):
                found.append((node.lineno, first.value))
    return found


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _module_name(path: Path, package: str) -> str:
    relative = path.relative_to(ROOT / "packages" / package / "src").with_suffix("")
    return ".".join(relative.parts)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_down_the_layers(package: str) -> None:
    violations = []
    for path in _runtime_files(package):
        tree = ast.parse(path.read_text(), str(path))
        for lineno, name in _imports(tree, _module_name(path, package)):
            parts = name.split(".")
            if parts[0] == "quantbridge" and len(parts) > 1:
                sibling = parts[1]
                if sibling != package and sibling not in ALLOWED_SIBLINGS[package]:
                    violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
            if package == "kernels" and parts[0] == "torch":
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports torch")
        if package == "kernels":  # nor lazily: importlib.import_module("torch"), __import__
            for lineno, name in _dynamic_imports(tree):
                if name.split(".")[0] == "torch":
                    violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    assert not violations, "rule 1 (imports go down):\n" + "\n".join(violations)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_imports_across_packages(package: str) -> None:
    violations = []
    for path in _runtime_files(package):
        tree = ast.parse(path.read_text(), str(path))
        for lineno, name in _private_sibling_imports(tree, _module_name(path, package), package):
            violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    for path in _test_files(package):
        allowed = TEST_PRIVATE_IMPORT_EXCEPTIONS.get(path.relative_to(ROOT).as_posix(), set())
        tree = ast.parse(path.read_text(), str(path))
        for lineno, name in _private_sibling_imports(tree, f"tests.{path.stem}", package):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    assert not violations, (
        "no package imports another package's _private modules; export the name from the "
        "owning package's __init__.py instead:\n" + "\n".join(violations)
    )


# private attribute names of torch and numba objects that a package also happens to define
# on its own classes (nn.Module's _modules, a tensor's _version, a numba dispatcher's _cache,
# a numba intrinsic's _name, read in kernels' numba compatibility module)
THIRD_PARTY_PRIVATE_ATTRIBUTES = {"_modules", "_version", "_cache", "_name"}


def _private_members(package: str) -> set[str]:
    """``_private`` names a package defines on its classes: methods and class attributes,
    and attributes set on ``self`` / ``cls``."""
    names: set[str] = set()
    for path in _runtime_files(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = (
                        [item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        else [t.id for t in item.targets if isinstance(t, ast.Name)]
                        if isinstance(item, ast.Assign)
                        else [item.target.id]
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        else []
                    )  # fmt: skip
                    names.update(t for t in targets if _is_private(t))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and _is_private(node.attr)
            ):
                names.add(node.attr)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _sibling_private_reads(
    tree: ast.AST, own: set[str], siblings: set[str]
) -> list[tuple[int, str]]:
    """Reads of ``x._name`` where ``_name`` is a sibling's private member and not this
    package's own (``self._name`` is always the package's own)."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and node.attr in siblings - own - THIRD_PARTY_PRIVATE_ATTRIBUTES
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append((node.lineno, node.attr))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_attributes_read_across_packages(package: str) -> None:
    own = _private_members(package)
    siblings = set().union(*(_private_members(p) for p in PACKAGES if p != package))
    violations = [
        f"{path.relative_to(ROOT)}:{lineno} reads .{name}, another package's private member"
        for path in _runtime_files(package)
        for lineno, name in _sibling_private_reads(
            ast.parse(path.read_text(), str(path)), own, siblings
        )
    ]
    assert not violations, (
        "no package reads another package's _private attributes; give the owner a public "
        "accessor:\n" + "\n".join(violations)
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_torch_ao_or_quantized_tensors_in_runtime_code(package: str) -> None:
    violations = []
    for path in _runtime_files(package):
        if path.as_posix().endswith(COMPARISON_BASELINE_MODULES):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for lineno, name in _imports(tree, _module_name(path, package)):
            if name == "torch.ao" or name.startswith("torch.ao."):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
        for node in ast.walk(tree):
            dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
            if dotted and any(
                dotted == bad or dotted.startswith(bad + ".") for bad in FORBIDDEN_ATTRIBUTES
            ):
                violations.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {dotted}")
    assert not violations, "rule 2 (no torch.ao, no quantized tensors):\n" + "\n".join(
        sorted(set(violations))
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_declared_dependencies_cover_sibling_imports(package: str) -> None:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        declared = " ".join(tomllib.load(f)["project"].get("dependencies", []))
    used = set()
    for path in _runtime_files(package):
        tree = ast.parse(path.read_text(), str(path))
        for _, name in _imports(tree, _module_name(path, package)):
            parts = name.split(".")
            if parts[0] == "quantbridge" and len(parts) > 1 and parts[1] != package:
                used.add(parts[1])
    missing = [s for s in sorted(used) if f"quantbridge-{s.replace('_', '-')}" not in declared]
    assert not missing, f"packages/{package} imports undeclared siblings: {missing}"


def test_namespace_package_has_no_init() -> None:
    stray = sorted(
        str(p.relative_to(ROOT)) for p in ROOT.glob("packages/*/src/quantbridge/__init__.py")
    )
    assert not stray, f"quantbridge is a PEP 420 namespace; remove {stray}"


@pytest.mark.parametrize("package", PACKAGES)
def test_package_layout(package: str) -> None:
    base = ROOT / "packages" / package
    for required in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        assert (base / required).is_file(), f"packages/{package}/{required} is missing"
    source = base / "src" / "quantbridge" / package
    assert (source / "__init__.py").is_file()
    assert (source / "py.typed").is_file()
    init = ast.parse((source / "__init__.py").read_text())
    exported = [
        node
        for node in init.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    assert exported, f"quantbridge.{package}.__init__ must define __all__"


def test_rule_checker_catches_violations(tmp_path: Path) -> None:
    """The checks above must be able to fail: feed them a file that breaks both rules."""
    source = "import torch\nfrom torch.ao.quantization import QConfig\nx = torch.quint8\n"
    tree = ast.parse(source)
    names = [name for _, name in _imports(tree, "quantbridge.kernels._bad")]
    assert "torch.ao.quantization" in names
    dotted = [_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert "torch.quint8" in dotted
    lazy = "import importlib\nt = importlib.import_module('torch')\nq = __import__('torch.ao')\n"
    assert [name for _, name in _dynamic_imports(ast.parse(lazy))] == ["torch", "torch.ao"]
    relative = _imports(ast.parse("from ..qconfig import x\n"), "quantbridge.fx_quant._mod")
    assert ("quantbridge.qconfig") in [name for _, name in relative]
    for private in (
        "from quantbridge.qconfig._dtypes import QScheme\n",
        "import quantbridge.qconfig._dtypes\n",
        "from quantbridge.qconfig import _dtypes\n",
        "from ..qconfig._dtypes import QScheme\n",
    ):
        found = _private_sibling_imports(
            ast.parse(private), "quantbridge.fx_quant._mod", "fx_quant"
        )
        assert found, private
    reads = _sibling_private_reads(
        ast.parse("n = mod._weight_names\nm = self._weight_names\nk = mod._own\n"),
        own={"_own"},
        siblings={"_weight_names", "_own"},
    )
    assert reads == [(1, "_weight_names")]
    public = "from quantbridge.qconfig import QScheme\nfrom quantbridge.fx_quant import _ops\n"
    assert not _private_sibling_imports(ast.parse(public), "quantbridge.fx_quant._mod", "fx_quant")
