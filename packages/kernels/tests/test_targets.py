"""Target selection: explicit argument, environment variable, best target; refusal of
targets this CPU cannot run."""

from __future__ import annotations

import numpy as np
import pytest

from quantbridge.kernels import (
    ENV_VAR,
    TARGETS,
    KernelError,
    PackedLinearWeight,
    TargetUnavailableError,
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


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "generic"])
def test_this_machine_runs_every_target(target):
    # the machine has AVX-512 VNNI; all three targets must be exercised here
    if not target_supported(target):
        pytest.skip(f"this CPU lacks {target}")
    assert resolve_target(target) == target
