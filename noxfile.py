"""quantbridge's development workflow.

    nox -s tests        every package's tests and the cross-package tests in tests/, in one
                        virtualenv, two pytest-xdist workers; `-- packages/qconfig/tests` runs one
    nox -s tests_targets  the target matrix: kernels and model zoo at every x86 level
    nox -s tests_aarch64  the kernels suite on an emulated Arm64 CPU (qemu-user), Arm targets
    nox -s lint         ruff check + ruff format --check
    nox -s typecheck    mypy --strict, one package at a time
    nox -s build        wheels + sdists; each wheel installed alone in a fresh venv and imported
    nox -s demo         the project's main job
    nox -s bench_peers  int8 against ONNX Runtime, OpenVINO/NNCF and torch.ao (installs them)
    nox -s bench_llm    weight-only int8/int4 decoder LLMs against torchao, OpenVINO, llama.cpp
    nox -s docs         the documentation site (docs/, mkdocs.yml): mkdocs build --strict

Every install goes through constraints.txt. Virtualenvs are reused, and a session skips pip
entirely when nothing it installs from (constraints, pyproject files, its requirement list)
has changed since the last run: packages are installed editable, so source edits need no
reinstall.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself runs on 3.11 here
    import tomli as tomllib

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / "constraints.txt"
PACKAGES = ("patterns", "qconfig", "kernels", "fx_quant", "lowering")
TEST_REQUIREMENTS = ("pytest", "pytest-xdist", "hypothesis", "numpy", "torch", "matplotlib")
TEST_WORKERS = "2"
# matplotlib: compare_layers(...).plot() is tested (an optional extra of fx_quant).
# Extra installs the tests need: lowering's tests load a third-party backend through the
# `quantbridge.backends` entry point, from a small plugin distribution kept in its tests,
# and smoke-test the demo, which reads scikit-learn's digits data; qconfig's calibration
# observers are compared with ONNX Runtime's calibrators (which import onnx); fx_quant's
# ONNX export is run in ONNX Runtime (torch.onnx's exporter needs onnxscript).
TEST_EXTRAS = (
    "scikit-learn",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "-e",
    str(ROOT / "packages" / "lowering" / "tests" / "plugin"),
)

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _pyproject(package: str) -> dict:  # type: ignore[type-arg]
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _dist_name(package: str) -> str:
    return str(_pyproject(package)["project"]["name"])


_DIST_TO_PACKAGE = {_dist_name(p): p for p in PACKAGES}
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9_.\-]+)")


def _sibling_dependencies(package: str) -> list[str]:
    """Sibling packages this package declares, directly or through other siblings."""
    found: list[str] = []
    todo = [package]
    while todo:
        current = todo.pop()
        for requirement in _pyproject(current)["project"].get("dependencies", []):
            match = _REQ_NAME.match(requirement)
            sibling = _DIST_TO_PACKAGE.get(match.group(1)) if match else None
            if sibling and sibling not in found:
                found.append(sibling)
                todo.append(sibling)
    return found


def _install(session: nox.Session, *requirements: str) -> None:
    """pip install with the constraints, skipped when its inputs are unchanged."""
    digest = hashlib.sha256(CONSTRAINTS.read_bytes())
    digest.update("\0".join(requirements).encode())
    for package in PACKAGES:
        digest.update((ROOT / "packages" / package / "pyproject.toml").read_bytes())
    stamp = Path(session.virtualenv.location) / ".quantbridge-install-stamp"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        session.log("requirements unchanged since the last run: skipping pip")
        return
    session.install("-c", str(CONSTRAINTS), *requirements)
    stamp.write_text(digest.hexdigest())


def _editable(*packages: str) -> list[str]:
    args: list[str] = []
    for package in packages:
        args += ["-e", str(ROOT / "packages" / package)]
    return args


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests and tests/, in one virtualenv; ``-- PATH ...`` runs fewer.

    Arguments after ``--`` go to pytest. Without a path, pytest runs its ``testpaths``
    (packages/*/tests and tests/, from pyproject.toml), so new test directories join by
    themselves; ``nox -s tests -- packages/qconfig/tests -k histogram`` runs one package's.

    The kernels suite runs the cases of this CPU's best kernel target; ``tests_targets`` runs
    every other target's, each with numba compiling for a CPU of that target
    (``QUANTBRIDGE_TEST_TARGETS=avx2,generic nox -s tests`` picks others here).
    """
    _install(session, *TEST_REQUIREMENTS, *_editable(*PACKAGES), *TEST_EXTRAS)
    session.env["QUANTBRIDGE_TEST_TARGETS"] = os.environ.get("QUANTBRIDGE_TEST_TARGETS", "best")
    # Two workers for two cores (`-- -n 0` runs in one process). numba's on-disk cache lives
    # beside the editable sources, so the workers and later runs reuse each other's kernels.
    session.run("pytest", "-n", TEST_WORKERS, *session.posargs)


@nox.session
def tests_targets(session: nox.Session) -> None:
    """The target matrix (targets/): each x86 kernel level forced through numba's CPU settings.

    Per level this host runs: the kernels suite and the model zoo's lowered outputs (equal
    bytes at every level). Per level above AVX2, on any host: every kernel family compiled for
    that CPU, nothing run. Arguments after ``--`` go to pytest (``-k avx2``).
    """
    _install(session, *TEST_REQUIREMENTS, *_editable(*PACKAGES), *TEST_EXTRAS)
    session.run("pytest", str(ROOT / "targets"), "-v", *session.posargs)


# tests_aarch64: an arm64 Python from Debian's packages (the release whose Python is 3.11, as
# the host's wheels are pinned for), its wheels installed by the host's pip, everything run
# by qemu-user. qemu-user shows LLVM a featureless "generic" CPU, so numba is told the CPU's
# features (as a user would for a cache that travels, see kernels/_targets.py); -cpu max
# makes qemu execute them.
AARCH64_DEBIAN = ("bookworm", "python3.11")
AARCH64_PACKAGES = "python3,libpython3.11,libstdc++6,libgcc-s1,zlib1g"
AARCH64_FEATURES = "+neon,+dotprod,+i8mm"
AARCH64_WHEELS = ("numpy", "numba", "llvmlite", "pytest", "pytest-xdist", "hypothesis")
# the families with Arm kernels (GEMM: linear, float and dynamic linear, conv, matmul,
# recurrent) and the target rules; the other families run the portable code every target
# shares, which tests_targets covers
AARCH64_SUITE = (
    "test_targets.py", "test_gemm.py", "test_linear.py", "test_linear_dynamic_fused.py",
    "test_matmul.py", "test_conv.py", "test_sequence.py", "test_weight_only.py",
)  # fmt: skip


@nox.session
def tests_aarch64(session: nox.Session) -> None:
    """The kernels suite on an emulated Arm64 CPU: targets ``aarch64_i8mm`` and
    ``aarch64_dotprod`` (``usdot`` / ``sdot``) against the same integer references.

    Installs what it needs: Debian's ``qemu-user-static`` and ``mmdebstrap`` (apt-get, as
    root) when missing, an arm64 root file system with Python (in the session's directory),
    and the arm64 wheels. Emulation says nothing about speed (README: Arm64). Arguments after
    ``--`` go to pytest (``-k conv``).
    """
    tools = ("qemu-aarch64-static", "mmdebstrap")
    if any(shutil.which(tool) is None for tool in tools):
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run("apt-get", "install", "-y", "-qq", "qemu-user-static", "mmdebstrap",
                    external=True, env=env)  # fmt: skip
    home = Path(session.virtualenv.location)
    release, python = AARCH64_DEBIAN
    root = home / "arm64-root"
    if not (root / "usr" / "bin" / python).exists():
        shutil.rmtree(root, ignore_errors=True)
        session.run("mmdebstrap", "--variant=extract", "--arch=arm64",
                    f"--include={AARCH64_PACKAGES}", release, str(root),
                    "http://deb.debian.org/debian", external=True)  # fmt: skip
    site = home / "arm64-site"
    stamp = site / ".quantbridge-wheels"
    want = CONSTRAINTS.read_text() + " ".join(AARCH64_WHEELS)
    if not stamp.exists() or stamp.read_text() != want:
        shutil.rmtree(site, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "--quiet", "--only-binary=:all:",
                    "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux_2_17_aarch64",
                    "--python-version", python.removeprefix("python"), "--implementation", "cp",
                    "--target", str(site), "-c", str(CONSTRAINTS), *AARCH64_WHEELS)  # fmt: skip
        stamp.write_text(want)
    # the interpreter as a program on this host: a subprocess of a test (sys.executable)
    # runs under qemu too
    interpreter = home / "python-aarch64"
    interpreter.write_text(
        "#!/bin/sh\n"
        f'exec qemu-aarch64-static -cpu max -L "{root}" -0 "{interpreter}" '
        f'"{root}/usr/bin/{python}" "$@"\n'
    )
    interpreter.chmod(0o755)
    tests = ROOT / "packages" / "kernels" / "tests"
    # the CPU tables are checked against LLVM on x86 hosts (each Arm probe is a process,
    # slow under emulation)
    session.run(
        str(interpreter), "-m", "pytest", "-p", "no:cacheprovider", "-n", TEST_WORKERS,
        "-k", "not cpu_table", *(str(tests / name) for name in AARCH64_SUITE), *session.posargs,
        external=True,
        env={
            "PYTHONHOME": str(root / "usr"),
            "PYTHONPATH": f"{site}{os.pathsep}{ROOT / 'packages' / 'kernels' / 'src'}",
            "NUMBA_CPU_NAME": "generic",
            "NUMBA_CPU_FEATURES": AARCH64_FEATURES,
            "NUMBA_CACHE_DIR": str(home / "numba-cache"),
            "QUANTBRIDGE_TEST_TARGETS": "aarch64_i8mm,aarch64_dotprod",
        },
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _install(session, "ruff")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
@nox.parametrize("package", list(PACKAGES))
def typecheck(session: nox.Session, package: str) -> None:
    """mypy --strict on one package, with only its declared siblings importable."""
    _install(session, "mypy", *_editable(package, *_sibling_dependencies(package)))
    session.run(
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        f"quantbridge.{package}",
    )


def _check_independent_versions(session: nox.Session) -> dict[str, str]:
    """Each package has its own version; every sibling range admits the sibling's version."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    versions = {p: str(_pyproject(p)["project"]["version"]) for p in PACKAGES}
    for package in PACKAGES:
        if "version" in _pyproject(package)["project"].get("dynamic", []):
            session.error(f"packages/{package}: the version must be static in its pyproject")
        for text in _pyproject(package)["project"].get("dependencies", []):
            requirement = Requirement(text)
            sibling = _DIST_TO_PACKAGE.get(requirement.name)
            if sibling is None:
                continue
            if any(spec.operator in ("==", "===") for spec in requirement.specifier):
                session.error(
                    f"packages/{package}: pins sibling {requirement}; declare a range so the "
                    "packages version independently"
                )
            if not requirement.specifier.contains(Version(versions[sibling])):
                session.error(
                    f"packages/{package}: requires {requirement} but packages/{sibling} "
                    f"is {versions[sibling]}"
                )
    return versions


def _wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]


_IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
root = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [m.name for m in pkgutil.walk_packages(root.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
print(f"imported {len(names)} modules of {sys.argv[1]}")
"""


# The documentation site (mkdocs.yml, docs/). mkdocstrings reads the packages' sources
# statically (the handler's `paths`), so this session installs neither the packages nor torch.
DOCS_REQUIREMENTS = (
    "mkdocs",
    "mkdocs-material",
    "mkdocstrings",
    "mkdocstrings-python",
    "griffe",
    "mkdocs-autorefs",
    "pymdown-extensions",
    "ruff",  # mkdocstrings formats the signatures with it
)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: ``mkdocs build --strict`` into site/.

    Strict: a broken link, an unresolved cross-reference or a docstring griffe cannot parse
    fails the build. Arguments after ``--`` go to ``mkdocs build`` (``-- --site-dir /tmp/x``).
    """
    _install(session, *DOCS_REQUIREMENTS)
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(ROOT / "mkdocs.yml"),
        *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel and sdist; install each wheel alone in a fresh venv and import it."""
    _install(session, "build", "packaging")
    versions = _check_independent_versions(session)
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "python", "-m", "build", "--outdir", str(dist), str(ROOT / "packages" / package)
        )

    from packaging.requirements import Requirement

    wheels = {p: next(dist.glob(f"{_dist_name(p).replace('-', '_')}-*.whl")) for p in PACKAGES}
    for package, wheel in wheels.items():
        expected = f"-{versions[package]}-"
        if expected not in wheel.name:
            session.error(f"{wheel.name}: expected version {versions[package]}")

    for package, wheel in wheels.items():
        with tempfile.TemporaryDirectory(prefix=f"qb-{package}-") as tmp:
            venv = Path(tmp) / "venv"
            session.run("python", "-m", "venv", str(venv))
            python = str(venv / "bin" / "python")
            # Third-party requirements come from the index under the constraints; siblings
            # only from dist/ (--no-index), so a same-named package on an index is never used.
            third_party = sorted(
                {
                    req
                    for p in (package, *_sibling_dependencies(package))
                    for req in _wheel_requirements(wheels[p])
                    if Requirement(req).name not in _DIST_TO_PACKAGE
                }
            )
            if third_party:
                session.run(
                    python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *third_party
                )
            session.run(
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--find-links",
                str(dist),
                str(wheel),
            )
            session.run(python, "-c", _IMPORT_EVERY_MODULE, f"quantbridge.{package}")
    session.log("versions: " + json.dumps(versions))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: see examples/demo.py."""
    _install(session, "torch", "scikit-learn", *_editable(*PACKAGES))
    session.run("python", str(ROOT / "examples" / "demo.py"), *session.posargs)


# Peer runtimes the benchmarks compare against (pinned in constraints.txt). Only the bench
# sessions install them; the tests session never does. onnxscript: torch.onnx's exporter.
PEER_REQUIREMENTS = ("onnx", "onnxscript", "onnxruntime", "openvino", "nncf", "transformers")


@nox.session
def bench_peers(session: nox.Session) -> None:
    """packages/lowering/bench/bench_peers.py: quantbridge beside ONNX Runtime, OpenVINO, torch.ao.

    Arguments after ``--`` go to the script, e.g. ``nox -s bench_peers -- --models resnet18
    --threads 1 --rounds 5 --json peers.json``.
    """
    _install(session, "torch", *PEER_REQUIREMENTS, *_editable(*PACKAGES))
    session.run(
        "python", str(ROOT / "packages" / "lowering" / "bench" / "bench_peers.py"), *session.posargs
    )


@nox.session
def bench_onnx(session: nox.Session) -> None:
    """packages/lowering/bench/bench_onnx_export.py: export_onnx's file in ORT and OpenVINO.

    Arguments after ``--`` go to the script, e.g. ``nox -s bench_onnx -- --models resnet18
    --threads 1 --rounds 5 --json onnx.json``. ``nox -s bench_onnx -- --zoo`` runs
    check_onnx_zoo.py instead: every test-zoo model's file in ORT and OpenVINO against its
    reference model (fails beyond one quantization step); ``--zoo resnet18 bert`` names some.
    """
    _install(session, "torch", *PEER_REQUIREMENTS, *_editable(*PACKAGES))
    bench = ROOT / "packages" / "lowering" / "bench"
    if "--zoo" in session.posargs:
        names = [a for a in session.posargs if a != "--zoo"]
        session.run("python", str(bench / "check_onnx_zoo.py"), *names)
        return
    session.run("python", str(bench / "bench_onnx_export.py"), *session.posargs)


# bench_llm's peers on top of PEER_REQUIREMENTS: gguf writes llama.cpp's file from the torch
# tensors. torchao is installed in the newest version pip resolves beside the pinned torch (none:
# its columns say so). llama-cpp-python is compiled here from its sdist for this CPU (no
# prebuilt wheel); the wheel is kept in the session's venv under a key of the version, the
# CMake arguments and the CPU's flags, so later runs install it without compiling.
LLM_REQUIREMENTS = ("gguf==0.19.0",)
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_SERVER=OFF"
)
# bench_llm ``--isa avx2`` / ``--isa avx_vnni`` (bench_peers' ISA_CAPS): llama.cpp built for
# that level instead of this CPU, so every column runs the same instructions
_LLAMA_CPP_AVX2 = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
LLAMA_CPP_ISA_ARGS = {
    "avx2": f"{_LLAMA_CPP_AVX2} -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF",
    "avx_vnni": f"{_LLAMA_CPP_AVX2} -DGGML_AVX_VNNI=ON -DGGML_AVX512=OFF",
}


def _llama_cpp_cmake_args(posargs: Sequence[str]) -> str:
    """LLAMA_CPP_CMAKE_ARGS, held to the level ``--isa`` names in bench_llm's arguments."""
    args = list(posargs)
    isa = args[args.index("--isa") + 1] if "--isa" in args[:-1] else None
    if isa not in LLAMA_CPP_ISA_ARGS:
        return LLAMA_CPP_CMAKE_ARGS
    return LLAMA_CPP_CMAKE_ARGS.replace("-DGGML_NATIVE=ON", LLAMA_CPP_ISA_ARGS[isa])


def _llm_optional_peer(
    session: nox.Session, name: str, key: str, install: Callable[[], str]
) -> None:
    """Run ``install`` (returns what it installed) unless it last succeeded with the same
    ``key``; a failure is logged, and the bench reports that peer's columns as not installed."""
    stamp = Path(session.virtualenv.location) / f".bench-llm-{name}-stamp"
    if stamp.exists():
        last_key, _, outcome = stamp.read_text().partition("\n")
        if last_key == key:
            session.log(f"{name}: {outcome} (unchanged since the last run)")
            return
    try:
        outcome = install()
    except nox.command.CommandFailed as e:  # tried again next run
        session.warn(f"{name} not installed ({e.reason}): bench_llm reports its columns so")
        return
    session.log(f"{name}: {outcome}")
    stamp.write_text(f"{key}\n{outcome}")


def _llm_torchao(session: nox.Session) -> str:
    """The newest torchao pip's resolver installs beside the pinned torch, without replacing it."""
    report = Path(session.virtualenv.location) / "torchao-resolve.json"
    session.run(
        "python", "-m", "pip", "install", "--dry-run", "--quiet", "--upgrade",
        "--report", str(report), "-c", str(CONSTRAINTS), "torchao",
    )  # fmt: skip
    plan = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    if "torch" in plan:  # cannot happen under the torch pin, but never let it through
        return f"not installed (it would replace torch with {plan['torch']})"
    if "torchao" in plan:
        session.install("-c", str(CONSTRAINTS), f"torchao=={plan['torchao']}")
        return f"torchao {plan['torchao']}"
    return "torchao installed already (the newest that resolves)"


def _llm_llama_cpp_key(cmake_args: str) -> str:
    """The version, the CMake arguments and this CPU's flags (a native build)."""
    import platform

    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")), "")
    text = "\0".join((LLAMA_CPP_PYTHON, cmake_args, flags, platform.machine()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _llm_llama_cpp(session: nox.Session, key: str, cmake_args: str) -> str:
    """llama-cpp-python built from source (``cmake_args``), its wheel cached in the venv."""
    import time

    wheels = Path(session.virtualenv.location) / "llama-cpp-wheels" / key
    wheel = next(iter(sorted(wheels.glob("*.whl"))), None)
    if wheel is None:
        session.log(
            f"building {LLAMA_CPP_PYTHON} from source ({cmake_args}): "
            "minutes on 2 cores, once (the wheel is kept in the venv)"
        )
        build = wheels.with_name(key + ".tmp")
        shutil.rmtree(build, ignore_errors=True)
        start = time.monotonic()
        session.run(
            "python", "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
            "--no-cache-dir", "--wheel-dir", str(build), LLAMA_CPP_PYTHON,
            env={
                "CMAKE_ARGS": cmake_args,
                "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
            },
        )  # fmt: skip
        session.log(f"llama-cpp-python built in {time.monotonic() - start:.0f} s")
        build.rename(wheels)
        wheel = next(iter(sorted(wheels.glob("*.whl"))))
    # the dependencies from the index, then this wheel over any other build of the version
    session.install("-c", str(CONSTRAINTS), str(wheel))
    session.install("--no-deps", "--force-reinstall", str(wheel))
    return wheel.name


@nox.session
def bench_llm(session: nox.Session) -> None:
    """packages/lowering/bench/bench_llm.py: weight-only int8/int4 Llama decoders on the CPU.

    fp32 torch, torchao, OpenVINO/NNCF, llama.cpp (Q8_0/Q4_0), ONNX Runtime MatMulNBits and
    quantbridge, the same random weights in each. Arguments after ``--`` go to the script,
    e.g. ``nox -s bench_llm -- --config tiny --threads 1 --rounds 1`` (a smoke run), ``--
    --threads 1 2 --json llm.json`` (TinyLlama's shape, 1.1B parameters: long; ``--columns``
    runs fewer).
    """
    _install(session, "torch", *PEER_REQUIREMENTS, *LLM_REQUIREMENTS, *_editable(*PACKAGES))
    constraints = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()
    _llm_optional_peer(session, "torchao", constraints, lambda: _llm_torchao(session))
    cmake_args = _llama_cpp_cmake_args(session.posargs)
    key = _llm_llama_cpp_key(cmake_args)
    _llm_optional_peer(
        session,
        "llama-cpp-python",
        f"{constraints}-{key}",
        lambda: _llm_llama_cpp(session, key, cmake_args),
    )
    session.run(
        "python", str(ROOT / "packages" / "lowering" / "bench" / "bench_llm.py"), *session.posargs
    )


# --- benchmarks (asv_bench/, see asv_bench/README.md) ------------------------------------------

ASV_DIR = ROOT / "asv_bench"
ASV_CONFIG = str(ASV_DIR / "asv.conf.json")
# One fixed machine name, so results from every run here land in one comparable series.
ASV_MACHINE = "qb-shared-2core"
ASV_REQUIREMENTS = ("asv==0.6.6", "virtualenv")


def _asv_machine(session: nox.Session) -> None:
    """Write ~/.asv-machine.json for ASV_MACHINE (non-interactive, facts from this machine)."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        ram = meminfo.read_text().splitlines()[0].split(":", 1)[1].strip()
    session.run(
        "asv", "machine", "--yes", "--config", ASV_CONFIG, "--machine", ASV_MACHINE,
        "--os", f"{platform.system()} {platform.release()}", "--arch", platform.machine(),
        "--cpu", cpu, "--num_cpu", str(os.cpu_count()), "--ram", ram,
    )  # fmt: skip


def _asv_quick_run(session: nox.Session, *options: str) -> None:
    _asv_machine(session)
    session.run(
        "asv", "run", "--config", ASV_CONFIG, "--machine", ASV_MACHINE,
        "--quick", "--show-stderr", "HEAD^!", *options,
    )  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """asv run --quick on HEAD: every benchmark once, results in asv_bench/results/.

    Extra arguments go to asv run, e.g. ``nox -s bench -- --bench models``. asv installs the
    peers (PEER_REQUIREMENTS but transformers) into its own environment (asv.conf.json), so
    ``models.Models`` has its torch.ao / ONNX Runtime / OpenVINO reference rows.
    """
    _install(session, *ASV_REQUIREMENTS)
    _asv_quick_run(session, *session.posargs)


@nox.session
def bench_compare(session: nox.Session) -> None:
    """asv continuous BASE HEAD: fails when a benchmark got slower by more than the factor.

    ``nox -s bench_compare -- [BASE [HEAD]] [asv continuous options]``; BASE defaults to
    HEAD~1, the factor to 1.5 (the machine is shared: smaller factors flag noise).
    """
    _install(session, *ASV_REQUIREMENTS)
    _asv_machine(session)
    refs = [a for a in session.posargs[:2] if not a.startswith("-")]
    options = session.posargs[len(refs) :]
    base, head = (refs + ["HEAD~1", "HEAD"][len(refs) :])[:2]
    if not any(o.startswith(("--factor", "-f")) for o in options):
        options = ["--factor", "1.5", *options]
    session.run(
        "asv", "continuous", "--config", ASV_CONFIG, "--machine", ASV_MACHINE,
        "--show-stderr", "--split", *options, base, head,
    )  # fmt: skip


@nox.session
def dashboard(session: nox.Session) -> None:
    """asv publish into asv_bench/html/, then the headless-Chromium check of the page.

    Preview it with ``asv preview --config asv_bench/asv.conf.json`` (serves html/ locally).
    On a fresh clone (no results for this machine yet) it first runs the quick bench, as
    ``nox -s bench`` does. Chromium and npm come from Debian (apt-get) when they are not
    installed yet; the session says so before it installs them.
    """
    _install(session, *ASV_REQUIREMENTS, "pytest")
    results = ASV_DIR / "results" / ASV_MACHINE
    if not any(p.name != "machine.json" for p in results.glob("*.json")):
        session.log(f"no asv results for {ASV_MACHINE} yet: running the quick bench first")
        _asv_quick_run(session)
    session.run("asv", "publish", "--config", ASV_CONFIG)
    # Debian's chromium (the browser check) and npm (the page's JavaScript libraries, which
    # asv loads from CDNs; offline_dashboard.py serves them from html/vendor/ instead)
    missing = [tool for tool in ("chromium", "npm") if shutil.which(tool) is None]
    if missing:
        print(
            f"dashboard: {' and '.join(missing)} not found: installing them with the system "
            "package manager (apt-get update && apt-get install -y " + " ".join(missing) + ")",
            flush=True,
        )
        session.run("apt-get", "update", "-q", external=True)
        session.run("apt-get", "install", "-y", "-q", *missing, external=True)
    session.run("python", str(ASV_DIR / "offline_dashboard.py"))
    session.run(
        "pytest", "-v", str(ASV_DIR / "tests" / "test_dashboard.py"),
        env={"QB_REQUIRE_CHROMIUM": "1"},
    )  # fmt: skip
