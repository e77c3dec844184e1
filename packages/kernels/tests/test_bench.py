"""The bench script (``packages/kernels/bench/bench_kernels.py``, outside the package) runs end
to end (tiny shapes) and emits the documented JSON keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantbridge.kernels import available_targets

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_kernels.py"

KEYS = {
    "op",
    "shape",
    "target",
    "threads",
    "gops",
    "percent_of_peak",
    "baseline",
    "baseline_gops",
    "ratio",
}


def test_bench_json_quick():
    target = available_targets()[0]
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--json",
            "--quick",
            "--repeat",
            "1",
            "--min-time",
            "0.001",
            "--targets",
            target,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    ops = {"linear", "conv2d", "conv2d_cl", "depthwise", "stem"}
    if target == "avx2":  # 7-bit weights, 7-bit codes: the byte kernels with and without check
        ops |= {"linear_w7", "conv2d_cl_w7", "linear_a7", "conv2d_cl_a7"}
    assert {r["op"] for r in rows} == ops
    for row in rows:
        assert set(row) >= KEYS
        assert row["target"] == target
        assert row["threads"] == 1
        assert row["gops"] > 0
        if row["baseline"] is not None:
            assert row["ratio"] > 0
            # GOPS are printed to 0.1: recomputing the ratio from them is only meaningful for
            # baselines well above that (the quick shapes on a loaded machine can show 0.0)
            if row["baseline_gops"] >= 2:
                expected = row["gops"] / row["baseline_gops"]
                assert row["ratio"] == pytest.approx(expected, rel=0.05, abs=0.05)


def test_bench_refuses_bad_arguments():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--threads", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--threads" in proc.stderr


WEIGHT_ONLY_BENCH = BENCH.with_name("bench_weight_only.py")


def test_weight_only_bench_json_quick():
    """``bench_weight_only.py`` (decode GEMV against a streaming read, prefill GOPS) runs end to
    end on tiny shapes, one thread."""
    target = available_targets()[0]
    proc = subprocess.run(
        [sys.executable, str(WEIGHT_ONLY_BENCH), "--json", "--quick", "--repeat", "1",
         "--threads", "1", "--targets", target],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {(r["op"], r["bits"]) for r in rows} == {(op, b) for op in ("gemv", "prefill")
                                                     for b in (4, 8)}  # fmt: skip
    for row in rows:
        assert row["target"] == target
        assert row["threads"] == 1
        if row["op"] == "gemv":
            assert row["gbps"] > 0
            assert row["stream_gbps"] > 0
            assert row["ratio"] == pytest.approx(row["stream_us"] / row["us"])
        else:
            assert row["gops"] > 0
    bad = subprocess.run([sys.executable, str(WEIGHT_ONLY_BENCH), "--threads", "0"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0
    assert "thread counts" in bad.stderr
