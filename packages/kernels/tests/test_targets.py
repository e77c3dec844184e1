"""Target selection: explicit argument, environment variable, best target; refusal of
targets this CPU cannot run."""

from __future__ import annotations

import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from quantbridge.kernels import (
    ENV_VAR,
    TARGETS,
    KernelError,
    PackedLinearWeight,
    TargetUnavailableError,
    _targets,
    available_targets,
    best_target,
    cpu_features,
    resolve_target,
    target_supported,
)


def test_generic_always_available_and_last():
    assert available_targets()[-1] == "generic"
    assert best_target() == available_targets()[0]


def test_targets_follow_cpu_features():
    feats = cpu_features()
    assert target_supported("avx2") == ({"avx2", "fma"} <= feats)
    assert target_supported("avx512_vnni") == ("avx512vnni" in feats and "avx512bw" in feats)
    assert target_supported("avx_vnni") == ({"avx2", "fma", "avxvnni"} <= feats)
    assert not target_supported("sse9")


def test_explicit_argument_beats_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "generic")
    assert resolve_target() == "generic"
    assert resolve_target(best_target()) == best_target()
    monkeypatch.delenv(ENV_VAR)
    assert resolve_target() == best_target()


def test_environment_selects_packing_target(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "generic")
    assert PackedLinearWeight(np.ones((2, 4), np.int8), 0.1).target == "generic"


def test_unknown_target_names_the_choices(monkeypatch):
    with pytest.raises(KernelError, match="unknown kernel target 'neon'"):
        resolve_target("neon")
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(KernelError, match=ENV_VAR):
        resolve_target()


def test_unrunnable_target_is_refused(monkeypatch):
    import quantbridge.kernels._targets as targets

    monkeypatch.setattr(targets, "cpu_features", lambda: frozenset({"sse2"}))
    with pytest.raises(TargetUnavailableError, match="lacks"):
        resolve_target("avx512_vnni")
    assert targets.available_targets() == ["generic"]
    with pytest.raises(TargetUnavailableError):
        PackedLinearWeight(np.ones((2, 4), np.int8), 0.1, target="avx2")


_ON_ARM = platform.machine().lower() in ("aarch64", "arm64")


@pytest.mark.parametrize(
    "target", [t for t in TARGETS if t != "generic" and (t in _targets.ARM_TARGETS) == _ON_ARM]
)
def test_this_machine_runs_every_target(target):
    # the machine has AVX-512 VNNI; all three targets must be exercised here
    if not target_supported(target):
        pytest.skip(f"this CPU lacks {target}")
    assert resolve_target(target) == target


# --- the CPU numba compiles for: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES --------------------------


def _numba_cpu(monkeypatch, name, features):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)


@pytest.mark.parametrize(
    ("name", "features", "targets"),
    [
        ("x86-64", "", ["generic"]),
        ("generic", "", ["generic"]),
        ("x86-64-v3", "", ["avx2", "generic"]),
        ("haswell", "", ["avx2", "generic"]),
        ("znver3", "", ["avx2", "generic"]),
        ("alderlake", "", ["avx_vnni", "avx2", "generic"]),
        ("sierraforest", "", ["avx_vnni", "avx2", "generic"]),
        ("alderlake", "-avxvnni", ["avx2", "generic"]),
        ("x86-64-v3", "+avxvnni", ["avx_vnni", "avx2", "generic"]),
        ("znver5", "", ["avx512_vnni", "avx_vnni", "avx2", "generic"]),
        ("skylake-avx512", "", ["avx2", "generic"]),  # AVX-512 without VNNI
        ("cascadelake", "", ["avx512_vnni", "avx2", "generic"]),
        ("x86-64-v4", "+avx512vnni", ["avx512_vnni", "avx2", "generic"]),
        ("generic", "+avx2,+fma", ["avx2", "generic"]),
        # +avx512vnni brings avx512f (and so avx2, fma) but not avx512bw
        ("generic", "+avx512vnni", ["avx2", "generic"]),
        # turning a feature off turns off everything built on it
        ("icelake-server", "-avx512f", ["avx2", "generic"]),
        ("icelake-server", "-avx", ["generic"]),
        ("sapphirerapids", "-avx512vnni", ["avx_vnni", "avx2", "generic"]),
        ("sapphirerapids", "-avx512vnni,-avxvnni", ["avx2", "generic"]),
        ("a-cpu-llvm-does-not-know", "", ["generic"]),
    ],
)
def test_targets_follow_numba_cpu_settings(monkeypatch, name, features, targets):
    _numba_cpu(monkeypatch, name, features)
    assert available_targets() == targets
    if "avx512_vnni" not in targets:
        with pytest.raises(TargetUnavailableError, match="NUMBA_CPU_NAME"):
            resolve_target("avx512_vnni")


def test_a_cpu_name_without_features_keeps_the_host_features(monkeypatch):
    # numba then hands LLVM the host's feature list, which overrides the name's defaults
    import llvmlite.binding as llvm

    host = frozenset(f for f, on in llvm.get_host_cpu_features().items() if on)
    _numba_cpu(monkeypatch, "x86-64", None)
    assert cpu_features() == host


def test_numba_enable_avx_off_leaves_generic(monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "ENABLE_AVX", 0)
    assert [t for t in available_targets() if t not in _targets.ARM_TARGETS] == ["generic"]


# feature -> (LLVM IR of a function using it, the instruction showing LLVM had the feature)
_PROBES = {
    "avx2": ("<8 x i32>", "add", r"vpaddd\s+%ymm"),
    "fma": ("<8 x float>", "fma", r"vfmadd\d{3}"),  # FMA3, not FMA4's vfmaddps
    "avx512f": ("<16 x i32>", "add", r"vpaddd\s+%zmm"),
    "avx512bw": ("<64 x i8>", "add", r"vpaddb\s+%zmm"),
}


def _probe_ir(vtype, op):
    if op == "fma":
        body = f"%r = call {vtype} @llvm.fma.v8f32({vtype} %a, {vtype} %b, {vtype} %a)"
        head = f"declare {vtype} @llvm.fma.v8f32({vtype}, {vtype}, {vtype})\n"
    else:
        body, head = f"%r = add {vtype} %a, %b", ""
    return f"{head}define {vtype} @f({vtype} %a, {vtype} %b) {{\n  {body}\n  ret {vtype} %r\n}}\n"


_ARM_CPUS = sorted({*_targets._DOTPROD_CPUS, *_targets._I8MM_CPUS})


@pytest.mark.parametrize("cpu", sorted(set(_targets._CPU_DEFAULTS) - set(_ARM_CPUS)))
def test_cpu_table_agrees_with_llvm(cpu):
    """The table of named CPUs' features against the code LLVM emits for each (generic IR,
    which LLVM compiles for any CPU: nothing here can abort)."""
    import llvmlite.binding as llvm

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        x86 = llvm.Target.from_triple("x86_64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this llvmlite has no x86 backend (an Arm build): x86 hosts check the table")
    machine = x86.create_target_machine(cpu=cpu, features="", opt=2)
    table = _targets._CPU_DEFAULTS[cpu]
    for feature, (vtype, op, instruction) in _PROBES.items():
        module = llvm.parse_assembly(_probe_ir(vtype, op))
        asm = machine.emit_assembly(module)
        assert bool(re.search(instruction, asm)) == (feature in table), (cpu, feature)


_ARM_PROBE = """
import sys
import llvmlite.binding as llvm
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
cpu, name = sys.argv[1], sys.argv[2]
ir = (
    "define <4 x i32> @f(<4 x i32> %a, <16 x i8> %b, <16 x i8> %c) {\\n"
    f"  %r = call <4 x i32> @llvm.aarch64.neon.{name}.v4i32.v16i8(<4 x i32> %a, <16 x i8> %b, "
    "<16 x i8> %c)\\n  ret <4 x i32> %r\\n}\\n"
    f"declare <4 x i32> @llvm.aarch64.neon.{name}.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)\\n"
)
machine = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(cpu=cpu)
print(machine.emit_assembly(llvm.parse_assembly(ir)))
"""


@pytest.mark.parametrize("cpu", _ARM_CPUS)
def test_arm_cpu_table_agrees_with_llvm(cpu):
    """The Arm CPUs' dot-product and int8 matrix-multiply features against LLVM's AArch64
    backend (in llvmlite on every host): a CPU that has the feature emits its instruction; one
    that lacks it aborts LLVM, so each probe runs in its own process."""
    table = _targets._CPU_DEFAULTS[cpu]
    for feature, name in (("dotprod", "sdot"), ("i8mm", "usdot")):
        run = subprocess.run(
            [sys.executable, "-c", _ARM_PROBE, cpu, name], capture_output=True, text=True
        )
        emitted = run.returncode == 0 and re.search(rf"\b{name}\b", run.stdout) is not None
        assert emitted == (feature in table), (cpu, feature, run.stderr[-300:])


def test_weights_packed_for_a_target_this_cpu_lacks_refuse_to_unpickle(monkeypatch):
    import pickle

    from quantbridge.kernels import PackedConvWeight

    w = np.ones((8, 4, 3, 3), np.int8)
    blobs = [
        pickle.dumps(PackedConvWeight(w, 0.1, target=best_target())),
        pickle.dumps(PackedLinearWeight(np.ones((8, 4), np.int8), 0.1, target=best_target())),
    ]
    if best_target() == "generic":
        pytest.skip("this CPU runs only the generic target, which every CPU runs")
    monkeypatch.setattr(_targets, "cpu_features", lambda: frozenset({"sse2"}))
    for blob in blobs:
        with pytest.raises(TargetUnavailableError, match="pack the weights again"):
            pickle.loads(blob)
