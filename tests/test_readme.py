"""Every Python block in the README runs as written, in a fresh interpreter of its own; a
block marked ``<!-- needs: cuda -->`` runs where CUDA is (``pytest -m gpu``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:<!-- needs: (\w+) -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str | None, str]]:
    text = README.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found.append((f"README.md:{line}", m.group(1), m.group(2)))
    return found


BLOCKS = _blocks()


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 3
    assert sum(1 for _, needs, _ in BLOCKS if needs is None) >= 2


@pytest.mark.parametrize(
    ("needs", "code"),
    [
        pytest.param(needs, code, id=where, marks=[pytest.mark.gpu] if needs == "cuda" else [])
        for where, needs, code in BLOCKS
    ],
)
def test_readme_block_runs(needs: str | None, code: str, tmp_path: Path) -> None:
    if needs == "cuda" and not _cuda():
        pytest.skip("this block needs CUDA")
    assert needs in (None, "cuda"), f"unknown requirement {needs!r}"
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip(), "each block prints what it got"


def test_the_readme_fits_an_afternoon() -> None:
    assert len(README.read_text().splitlines()) <= 200
