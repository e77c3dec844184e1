"""The top README's ```python blocks run as written (the Quickstart), in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_python_blocks(text: str) -> list[str]:
    return _PYTHON_BLOCK.findall(text)


def test_block_extraction_finds_python_blocks_only() -> None:
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
    assert readme_python_blocks(text) == ["x = 1\n", "y = x\n"]


def test_readme_python_blocks_run(tmp_path: Path) -> None:
    blocks = readme_python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, f"{README}: no ```python block found (the Quickstart should be one)"
    script = tmp_path / "readme_blocks.py"
    # one script, blocks in order, so a later block may use names from an earlier one; its own
    # interpreter, so the Quickstart's torch.set_num_threads(1) does not leak into other tests
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"README python blocks failed:\n{result.stderr}"
    assert re.search(r"fp32 [\d.]+ ms, int8 [\d.]+ ms: [\d.]+x", result.stdout), result.stdout
