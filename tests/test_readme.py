"""The Quickstart runs as written, in a fresh interpreter.

It lives on the documentation site's Getting started page (docs/getting-started.md), and the
top README shows the same code: every ```python block of the README must be one of the page's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_python_blocks(text: str) -> list[str]:
    return _PYTHON_BLOCK.findall(text)


def test_block_extraction_finds_python_blocks_only() -> None:
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
    assert readme_python_blocks(text) == ["x = 1\n", "y = x\n"]


def test_readme_shows_the_getting_started_code() -> None:
    page = readme_python_blocks(GETTING_STARTED.read_text(encoding="utf-8"))
    readme = readme_python_blocks(README.read_text(encoding="utf-8"))
    assert readme, f"{README}: no ```python block found (the Quickstart should be one)"
    stale = [block for block in readme if block not in page]
    assert not stale, f"README blocks that differ from {GETTING_STARTED.name}'s:\n{stale}"


def test_getting_started_python_blocks_run(tmp_path: Path) -> None:
    blocks = readme_python_blocks(GETTING_STARTED.read_text(encoding="utf-8"))
    assert blocks, f"{GETTING_STARTED}: no ```python block found (the Quickstart should be one)"
    script = tmp_path / "getting_started_blocks.py"
    # one script, blocks in order, so a later block may use names from an earlier one; its own
    # interpreter, so the Quickstart's torch.set_num_threads(1) does not leak into other tests
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # the blocks write model.onnx
    )
    assert result.returncode == 0, f"Getting started python blocks failed:\n{result.stderr}"
    assert re.search(r"fp32 [\d.]+ ms, int8 [\d.]+ ms: [\d.]+x", result.stdout), result.stdout


def test_backend_guide_lists_every_rule_of_the_table_in_order() -> None:
    # the guide's rule table is written by hand: it must name each built-in rule, in order
    from quantbridge.lowering import default_lowering_rules

    page = (ROOT / "docs" / "backend-guide.md").read_text()
    start = page.index("| rule | float op patterns | kind | the builder emits |")
    rows = [line for line in page[start:].splitlines()[2:] if line.startswith("|")]
    listed = [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]
    assert listed == [rule.name for rule in default_lowering_rules()]
