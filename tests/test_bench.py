"""The README's main job runs end to end and writes its results (a real run, small)."""

from __future__ import annotations

import json
from pathlib import Path

from mmwire.bench._cli import main


def test_demo_runs_and_writes_results(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "results"), "demo"]) == 0
    (run,) = (tmp_path / "results").iterdir()
    data = json.loads((run / "results.json").read_text())
    assert len(data["rows"]) == 6 and all(
        r["mmwire_ms"] > 0 and r["pickle_ms"] > 0 for r in data["rows"]
    )
    assert data["machine"]["commit"]
    assert "mmwire demo" in (run / "table.txt").read_text()
    assert run.name in (tmp_path / "RESULTS.md").read_text()


def test_transport_runs_every_method(tmp_path: Path) -> None:
    assert (
        main(
            [
                "--out",
                str(tmp_path / "r"),
                "transport",
                "--sizes",
                "64K",
                "--consumers",
                "2",
                "--seconds",
                "0.1",
            ]
        )
        == 0
    )
    (run,) = (tmp_path / "r").iterdir()
    methods = {s["method"] for s in json.loads((run / "results.json").read_text())["samples"]}
    assert methods == {"mmwire", "pickle", "oob", "segment", "tmp_queue"}
