"""``QUANTBRIDGE_TEST_TARGETS=avx2`` (a comma-separated list): run only the cases of these
kernel targets, where a test is parametrized by target; ``best``: this CPU's best target.
Unset: every target this CPU runs.

The target matrix (``nox -s tests_targets``) runs this suite once per CPU level, each level
for the target it selects: a lower target's cases run at that target's own level, with numba
compiling for that CPU. ``nox -s tests`` runs the best target's (``best``), which the matrix
runs again at the host's level only.
"""

from __future__ import annotations

import os

import pytest

from quantbridge.kernels import TARGETS, best_target


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("QUANTBRIDGE_TEST_TARGETS")
    if not wanted:
        return
    keep = {best_target() if name == "best" else name for name in wanted.split(",")}
    selected, deselected = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        other = any(isinstance(v, str) and v in TARGETS and v not in keep for v in params)
        (deselected if other else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
