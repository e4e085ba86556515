"""mypy tells GlobalIndex and LocalIndex apart (style practice 15)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = Path(__file__).parent / "typing" / "index_misuse.py"


# torch's own annotations are most of mypy's work here and none of the test's: skipped
_CONFIG = "[mypy]\n[mypy-torch]\nfollow_imports = skip\n[mypy-torch.*]\nfollow_imports = skip\n"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_rejects_index_misuse(tmp_path: Path) -> None:
    config = tmp_path / "mypy.ini"
    config.write_text(_CONFIG)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--no-incremental",
            "--strict",
            "--no-error-summary",
            str(SNIPPET),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    expected = {
        i + 1: m.group(1)
        for i, line in enumerate(SNIPPET.read_text().splitlines())
        if (m := re.search(r"# E: (\S+)", line))
    }
    found = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r":(\d+): error: .*\[([\w-]+)\]", out.stdout)
    }
    assert found == expected, out.stdout + out.stderr
