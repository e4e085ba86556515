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


def test_pipeline_runs_both_modes_and_every_owner_reports(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "r"), "pipeline", "--requests", "3", "--rates", "1"]
    assert main(args) == 0
    (run,) = (tmp_path / "r").iterdir()
    rows = json.loads((run / "results.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"eager", "deferred"}
    for r in rows:  # _run raises if an owner of some request never reported
        assert len(r["ttft_s"]) == 3 and min(r["ttft_s"]) > 0
    deferred = next(r for r in rows if r["mode"] == "deferred")
    eager = next(r for r in rows if r["mode"] == "eager")
    assert deferred["payload_bytes"] * 3 < eager["payload_bytes"]  # uint8 vs fp32 patches


def test_gpu_commands_refuse_cleanly_without_cuda(tmp_path: Path) -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in ("kernels", "gpu-transport", "h2d"):
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            main(["--out", str(tmp_path / "r"), command])


def test_kernel_time_counts_overlapping_launches_once() -> None:
    from mmwire.bench._kernels import _covered

    assert _covered([]) == 0
    assert _covered([(0, 10), (20, 25)]) == 15  # the gap between launches is not kernel time
    assert _covered([(0, 10), (5, 12), (2, 3), (30, 31)]) == 13  # overlapping: once
    assert _covered([(5, 12), (0, 10)]) == 12
