"""The published asv dashboard, opened in headless Chromium (run by ``nox -s dashboard``).

Chromium's ``--dump-dom`` gives the DOM after the page's scripts ran and
``--enable-logging=stderr`` prints the console, where uncaught JavaScript errors appear; no
browser driver or websocket client is needed. The pages are served over HTTP from a local
thread because asv's page fetches its JSON, which Chromium blocks for file:// URLs.

Skips when Chromium or the published HTML is missing, unless QB_REQUIRE_CHROMIUM=1 (set by
the nox session), where a missing piece fails instead.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

HTML = Path(__file__).resolve().parents[1] / "html"
SCREENSHOT = HTML / "dashboard.png"
REQUIRED = os.environ.get("QB_REQUIRE_CHROMIUM") == "1"
# Benchmarks whose per-backend graphs the dashboard must list.
PER_BACKEND = [
    "models.Models.time_forward",
    "ops.Linear.time_linear",
    "ops.Conv2d.time_conv2d",
    "ops.Elementwise.time_op",
    "flow.Lower.time_lower",
    "flow.ColdStart.time_cold_start",
]
BACKENDS = ["fp32", "reference", "numba_avx512_vnni", "numba_avx2", "numba_generic"]
# Reference rows beside the backends on every models.Models page (asv_bench/benchmarks/_peers.py).
PEERS = ["torch_ao_x86", "onnxruntime_int8", "openvino_int8"]
LOG_SCALE_ON = re.compile(r'<a id="log-scale" class="[^"]*\bactive\b')
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=20000",
]


def _missing(why: str) -> None:
    if REQUIRED:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _missing("chromium is not installed (apt-get install chromium)")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    if not (HTML / "index.html").exists():
        _missing(f"{HTML}/index.html missing: run asv publish (nox -s dashboard)")
    with tempfile.TemporaryDirectory() as tmp:
        # a copy, so the deliberately broken page of the negative control stays out of html/
        root = Path(tmp) / "site"
        shutil.copytree(HTML, root)
        (root / "broken.html").write_text(
            "<html><body><script>undefinedFunctionCall();</script>ok</body></html>"
        )
        handler = functools.partial(_QuietHandler, directory=str(root))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _open(chromium: str, url: str, *extra: str) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console lines that report JavaScript errors)."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [
        line
        for line in proc.stderr.splitlines()
        if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)
    ]
    return proc.stdout, errors


def test_console_errors_are_detected(chromium: str, site: str) -> None:
    """Negative control: a page that throws must show up as an error."""
    _, errors = _open(chromium, f"{site}/broken.html", "--dump-dom")
    assert any("undefinedFunctionCall" in e for e in errors), errors


def test_index_loads_and_lists_every_benchmark(chromium: str, site: str) -> None:
    dom, errors = _open(chromium, f"{site}/index.html", "--dump-dom")
    assert errors == []
    for name in PER_BACKEND:
        assert name in dom, f"{name} not listed on the dashboard"


def test_per_backend_graphs(chromium: str, site: str) -> None:
    """Each parameterized benchmark's page offers every backend as a graph series."""
    with open(HTML / "index.json") as f:
        index = json.load(f)
    for name in PER_BACKEND:
        params = index["benchmarks"][name]["params"]
        offered = {p.strip("'") for p in params[0]}
        expected = set(BACKENDS) - ({"fp32"} if name.startswith("flow.") else set())
        if name.startswith("models."):
            expected |= set(PEERS)
        assert expected <= offered, (name, offered)
    dom, errors = _open(chromium, f"{site}/index.html#models.Models.time_forward", "--dump-dom")
    assert errors == []
    for backend in [*BACKENDS, "torch_native", *PEERS]:
        assert backend in dom, f"no {backend} series on the models.Models.time_forward page"
    graphs = list((HTML / "graphs").rglob("models.Models.time_forward.json"))
    assert graphs, "no graph data published for models.Models.time_forward"


def _first_model() -> str:
    with open(HTML / "index.json") as f:
        params = json.load(f)["benchmarks"]["models.Models.time_forward"]["params"]
    return str(params[1][0]).strip("'")


def test_graphs_open_with_a_log_axis(chromium: str, site: str) -> None:
    """A 1 ms backend and a 180 ms one stay readable: the y axis starts logarithmic, and an
    explicit linear choice in the URL is kept (offline_dashboard.py patches asv's script)."""
    page = f"{site}/index.html#models.Models.time_forward"
    dom, errors = _open(chromium, page, "--dump-dom")
    assert errors == []
    assert LOG_SCALE_ON.search(dom), "the log scale button is not pressed by default"
    # every column is drawn by default (asv alone draws 8 curves): the legend names each
    first_model = _first_model()
    for backend in [*BACKENDS, "torch_native", *PEERS]:
        label = f"backend-{backend}; model-{first_model}"
        assert label in dom, f"{label} is not drawn on the default graph"
    dom, errors = _open(chromium, f"{page}?y-axis-scale=linear", "--dump-dom")
    assert errors == []
    assert 'id="log-scale"' in dom
    assert not LOG_SCALE_ON.search(dom), "y-axis-scale=linear still shows a log axis"


def test_screenshot(chromium: str, site: str) -> None:
    if SCREENSHOT.exists():
        SCREENSHOT.unlink()
    _open(
        chromium,
        f"{site}/index.html#models.Models.time_forward",
        f"--screenshot={SCREENSHOT}",
        "--window-size=1400,1000",
    )
    assert SCREENSHOT.exists()
    assert SCREENSHOT.stat().st_size > 10_000
