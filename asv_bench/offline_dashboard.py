"""Make the published asv dashboard work without internet: vendor its JavaScript and CSS.

asv 0.6.6's ``index.html`` loads jQuery, Flot, Bootstrap, stupidtable and blueimp-md5 from
public CDNs; on a machine that reaches only package registries the page then shows "failed to
load external dependencies" and draws nothing. This script fetches the same libraries from the
npm registry (``npm pack``, cached in ``asv_bench/.asv/vendor/``), copies them into
``html/vendor/`` and points the page's ``<script>``/``<link>`` tags there (dropping the CDN
integrity attributes: the npm files are the libraries' own builds, not the CDN's re-minified
bytes). Any CDN URL it does not know fails the script, so an asv upgrade that adds one is seen.

It also makes a logarithmic y axis the default of every benchmark graph (asv's "log scale"
button starts pressed): one graph holds a backend at 1 ms and a peer or the reference backend
at 180 ms, which a linear axis squashes to a line at zero. The button still switches to a
linear axis (the URL then says ``y-axis-scale=linear``). And a graph draws up to 16 curves by
default (asv: 8), so every backend and peer row of ``models.Models`` is drawn. A patch whose
asv code is not found fails the script, like an unknown CDN URL.

    python asv_bench/offline_dashboard.py      (run by ``nox -s dashboard`` after asv publish)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HTML = HERE / "html"
CACHE = HERE / ".asv" / "vendor"

# CDN URL -> (npm package spec, file inside the package tarball)
ASSETS: dict[str, tuple[str, str]] = {
    "https://code.jquery.com/jquery-3.3.1.min.js": ("jquery@3.3.1", "package/dist/jquery.min.js"),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js": (
        "flot@0.8.3",
        "package/jquery.flot.js",
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.time.min.js": (
        "flot@0.8.3",
        "package/jquery.flot.time.js",
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.selection.min.js": (
        "flot@0.8.3",
        "package/jquery.flot.selection.js",
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.categories.min.js": (
        "flot@0.8.3",
        "package/jquery.flot.categories.js",
    ),
    "https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js": (
        "flot-orderbars@1.0.0",
        "package/js/jquery.flot.orderBars.js",
    ),
    # the CDN's 1.0.1 is not on npm; 1.1.3 is the only published version (same jQuery API)
    "https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js": (
        "stupid-table-plugin@1.1.3",
        "package/stupidtable.min.js",
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/blueimp-md5/2.19.0/js/md5.min.js": (
        "blueimp-md5@2.19.0",
        "package/js/md5.min.js",
    ),
    "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/js/bootstrap.min.js": (
        "bootstrap@3.1.1",
        "package/dist/js/bootstrap.min.js",
    ),
    "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css": (
        "bootstrap@3.1.1",
        "package/dist/css/bootstrap.min.css",
    ),
}
# Bootstrap's CSS refers to ../fonts/; copied beside it.
EXTRA_DIRS = {"bootstrap@3.1.1": "package/dist/fonts/"}
# asv's graphdisplay.js: (code as asv 0.6.6 ships it, replacement). The first makes "log" the
# y-axis scale of a URL that names none; the second keeps an explicit linear choice in the URL
# (asv would drop the parameter, which now means log).
GRAPH_PATCHES: list[tuple[str, str]] = [
    (
        "        if (params['y-axis-scale']) {\n",
        "        if (!params['y-axis-scale']) {\n"
        "            params['y-axis-scale'] = ['log'];  // quantbridge: log scale by default\n"
        "        }\n"
        "        if (params['y-axis-scale']) {\n",
    ),
    (
        "update_state_url({'y-axis-scale': log_scale ? ['log']: []});",
        "update_state_url({'y-axis-scale': log_scale ? ['log']: ['linear']});",
    ),
    # asv draws at most 8 curves by default: models.Models has 10 backend columns (fp32,
    # reference, three numba targets, torch_native, three peers), so its default plot would
    # drop the last peers. 16 draws every column of the first model.
    ("var max_curves = 8;", "var max_curves = 16;"),
]
TAG = re.compile(r"<(script|link)\b[^>]*?(?:src|href)=\"(https?://[^\"]+)\"[^>]*>")
DROP_ATTRS = re.compile(r'\s+(?:integrity|crossorigin|referrerpolicy)="[^"]*"')


def _tarball(spec: str) -> Path:
    name, version = spec.rsplit("@", 1)
    path = CACHE / f"{name}-{version}.tgz"
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            sys.exit("offline_dashboard: npm is needed to fetch the dashboard's libraries")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "pack", "-q", "--pack-destination", str(CACHE), spec], check=True)
    return path


def _extract(spec: str, member: str, vendor: Path) -> str:
    """Copy one file of the package into html/vendor/<package>/...; its URL relative to html/."""
    rel = Path(spec.rsplit("@", 1)[0]) / member.removeprefix("package/")
    target = vendor / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(_tarball(spec)) as tar:
        source = tar.extractfile(member)
        if source is None:
            sys.exit(f"offline_dashboard: {member} missing from {spec}")
        target.write_bytes(source.read())
        prefix = EXTRA_DIRS.get(spec)
        if prefix:
            for info in tar.getmembers():
                if info.isfile() and info.name.startswith(prefix):
                    extra = vendor / spec.rsplit("@", 1)[0] / info.name.removeprefix("package/")
                    extra.parent.mkdir(parents=True, exist_ok=True)
                    data = tar.extractfile(info)
                    assert data is not None
                    extra.write_bytes(data.read())
    return f"vendor/{rel.as_posix()}"


def patch_graph_display(script: Path) -> None:
    """Apply GRAPH_PATCHES to asv's graph page script (each once: reruns are no-ops)."""
    text = script.read_text()
    for old, new in GRAPH_PATCHES:
        if new in text:
            continue
        if text.count(old) != 1:
            sys.exit(f"offline_dashboard: {script.name}: asv code to patch not found: {old!r}")
        text = text.replace(old, new)
    script.write_text(text)
    print(f"offline_dashboard: {script.name}: graphs open with a log y axis and up to 16 curves")


def main() -> int:
    patch_graph_display(HTML / "graphdisplay.js")
    vendor = HTML / "vendor"
    for page in sorted(HTML.glob("*.html")):
        text = page.read_text()
        unknown = [url for _, url in TAG.findall(text) if url not in ASSETS]
        if unknown:
            sys.exit(f"offline_dashboard: {page.name} loads unknown external files {unknown}")

        def local(match: re.Match[str]) -> str:
            spec, member = ASSETS[match.group(2)]
            tag = match.group(0).replace(match.group(2), _extract(spec, member, vendor))
            return DROP_ATTRS.sub("", tag)

        page.write_text(TAG.sub(local, text))
        print(f"offline_dashboard: {page.name}: external files now served from html/vendor/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
