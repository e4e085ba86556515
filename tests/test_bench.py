"""The README's main job runs end to end and writes its results (a real run, small)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mmwire.bench._cli import main
from mmwire.bench._engine import trace
from mmwire.bench._transport import LABELS, PEERS


def test_demo_shows_every_path_at_80_columns_and_writes_only_its_results(tmp_path: Path) -> None:
    # the README's first command, as a user runs it: no terminal, defaults, a fresh folder
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    bench = Path(sys.executable).with_name("mmwire-bench")
    run = subprocess.run(
        [str(bench), "demo", "--reps", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].startswith("mmwire demo:")  # says what it does before it works
    for peer in PEERS:  # each peer's id, with the name the README gives it
        assert any(line.split()[:1] == [peer] and LABELS[peer] in line for line in lines[1:6])
    header = next(line for line in lines if line.split()[:2] == ["req", "MP"])
    assert header.split()[2:] == ["mmwire", *PEERS]  # every peer, side by side, whole
    assert "no joined member" not in run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mmwire-results"]  # nothing else
    (folder,) = (tmp_path / "mmwire-results").iterdir()
    data = json.loads((folder / "results.json").read_text())
    assert len(data["rows"]) == 6 and data["paths"] == ["mmwire", *PEERS]
    for row in data["rows"]:
        for path in data["paths"]:
            assert len(row[f"{path}_ms"]) == 1 and min(row[f"{path}_ms"]) > 0
    assert data["machine"]["commit"]
    assert f"results: {folder.relative_to(tmp_path)}" in run.stdout


def test_record_keeps_the_latest_run_per_benchmark_and_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    small = ["transport", "--sizes", "16K", "--consumers", "1", "--methods", "mmwire"]
    small += ["--seconds", "0.05", "--throughput-requests", "5"]
    with pytest.raises(SystemExit):  # outside a checkout there is no record to update
        main(["--record", *small])
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for _ in range(2):
        assert main(["--record", *small]) == 0
    (folder,) = (tmp_path / "bench" / "results").iterdir()
    assert folder.name.startswith("transport-")
    index = (tmp_path / "bench" / "RESULTS.md").read_text()
    assert index.count(f"## {folder.name}") == 1 and "mmwire" in index


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
                "1",
                "--seconds",
                "0.1",
                "--throughput-requests",
                "50",
                "--methods",
                ",".join(["mmwire", *PEERS, "zmq_frames", "mooncake_tcp", "pickle_tcp"]),
            ]
        )
        == 0
    )
    (run,) = (tmp_path / "r").iterdir()
    samples = json.loads((run / "results.json").read_text())["samples"]
    local = {"mmwire", "pickle", "oob", "segment", "tmp_queue"}
    cross = {"zmq_frames", "mooncake_tcp", "pickle_tcp"} - _missing_engine()
    assert {s["method"] for s in samples} == local | cross
    assert all(s["consumers"] == 1 and s["cpu_s_per_1000"] > 0 for s in samples)
    rates = [s for s in samples if "requests_per_s" in s]
    # the unpaced rate is measured for the local ways (the engine is in the test extra)
    assert {s["method"] for s in rates} == local and all(s["requests_per_s"] > 0 for s in rates)
    assert "to a rank on another host" in (run / "table.txt").read_text()


def _transport_cli(tmp_path: Path, methods: str) -> subprocess.CompletedProcess[str]:
    args = ["transport", "--sizes", "16K", "--consumers", "1", "--seconds", "0.05"]
    args += ["--throughput-requests", "5", "--methods", methods]
    return subprocess.run(
        [str(Path(sys.executable).with_name("mmwire-bench")), "--out", str(tmp_path / "r"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the peers extra)")
def test_vllm_peers_run_without_the_warnings_vllm_makes_torch_print(tmp_path: Path) -> None:
    run = _transport_cli(tmp_path, "mmwire,vllm_mq,vllm_store")
    assert "deprecated" not in run.stderr, run.stderr  # torch's, in every rank importing vLLM
    (folder,) = (tmp_path / "r").iterdir()
    samples = json.loads((folder / "results.json").read_text())["samples"]
    assert {s["method"] for s in samples} == {"mmwire", "vllm_mq", "vllm_store"}


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (the peers extra)"
)
def test_transport_says_in_one_line_that_it_skipped_vllm_without_it(tmp_path: Path) -> None:
    run = _transport_cli(tmp_path, "mmwire,vllm_mq,vllm_store")
    skipped = [line for line in run.stdout.splitlines() if "vLLM's peers skipped" in line]
    assert len(skipped) == 1, run.stdout
    assert "pip install '.[peers]'" in skipped[0]  # the extra's name, not eaten as markup
    (folder,) = (tmp_path / "r").iterdir()
    samples = json.loads((folder / "results.json").read_text())["samples"]
    assert {s["method"] for s in samples} == {"mmwire"}


def _missing_engine() -> set[str]:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return {"mooncake_tcp"}
    return set()


def test_pipeline_runs_every_way_from_the_bytes_and_every_owner_reports(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "r"), "pipeline", "--requests", "3", "--rates", "1"]
    args += ["--max-megapixels", "1"]
    assert main(args) == 0
    (run,) = (tmp_path / "r").iterdir()
    rows = json.loads((run / "results.json").read_text())["rows"]
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"eager", "raw", "encoded"}
    for r in rows:  # _run raises if an owner of some request never reported
        assert len(r["ttft_s"]) == 3 and min(r["ttft_s"]) > 0
        assert r["producer_cpu_s_per_request"] > 0
    # the same requests: fp32 patches > uint8 pixels > the client's compressed bytes
    assert by_mode["raw"]["payload_bytes"] < by_mode["eager"]["payload_bytes"]
    assert by_mode["encoded"]["payload_bytes"] * 5 < by_mode["raw"]["payload_bytes"]
    assert "vs raw" in (run / "table.txt").read_text()


def test_engine_runs_the_trace_both_ways_and_the_async_overhead(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "r"), "engine", "--conversations", "2", "--turns", "3"]
    args += ["--max-megapixels", "0.8"]
    assert main([*args, "--reps", "20"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    data = json.loads((run / "results.json").read_text())
    assert (data["requests"], data["images"], data["repeats"]) == (6, 12, 6)
    off, on = data["trace"]
    assert off["way"] == "no reuse" and on["way"] == "reuse + cache"
    assert off["cache_hits"] == 0 and on["cache_hits"] == 6  # every repeat, once per turn
    assert off["bytes_named"] == on["bytes_named"]  # the same requests, the same envelopes
    requests = trace(2, 3, max_megapixels=0.8)
    assert off["bytes_copied"] == sum(len(b) for r in requests for b in r)
    # only each conversation's new image was copied: its last turn holds them all once
    assert on["bytes_copied"] == sum(len(b) for r in requests[-2:] for b in r)
    assert {(r["payload"], r["mode"]) for r in data["overhead"]} == {
        (p, m) for p in ("64 KiB", "4 MiB") for m in ("sync", "async")
    }
    assert all(len(r["seconds"]) == 20 for r in data["overhead"])
    assert "async 64 KiB" in (run / "table.txt").read_text()


def test_gpu_commands_refuse_cleanly_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in ("kernels", "gpu-transport", "h2d"):
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            main(["--out", str(tmp_path / "r"), command])


def test_kernels_cases_are_chosen_by_parts_of_their_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a GPU call can run one family's rows; a part that names no case is refused before
    # anything runs (CUDA or not), with the cases listed
    from mmwire.bench._kernels import kernel_cases, select_cases

    names = list(kernel_cases())
    assert select_cases(None) == names
    assert select_cases("internvl3, gemma 3") == [
        "InternVL3 8 mixed",
        "Gemma 3 8 mixed",
        "Gemma 3 pan-and-scan",
    ]
    assert select_cases("QWEN") == ["Qwen2.5-VL 8 mixed", "Qwen3-VL 8 mixed"]
    for wanted in ("gemma,nope", ","):
        with pytest.raises(SystemExit, match=r"no kernels case matches .*InternVL3 8 mixed"):
            main(["--out", str(tmp_path / "r"), "kernels", "--cases", wanted])
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):  # the record keeps every case's rows
        main(["--record", "kernels", "--cases", "gemma"])
    assert "leave --cases out" in capsys.readouterr().err


def test_kernel_time_counts_overlapping_launches_once() -> None:
    from mmwire.bench._kernels import _covered

    assert _covered([]) == 0
    assert _covered([(0, 10), (20, 25)]) == 15  # the gap between launches is not kernel time
    assert _covered([(0, 10), (5, 12), (2, 3), (30, 31)]) == 13  # overlapping: once
    assert _covered([(5, 12), (0, 10)]) == 12


def test_kernel_labels_name_the_fused_kinds_and_the_resize_passes() -> None:
    # the profiler's names of mmwire's kernels, as the kernels record's breakdown labels them
    from mmwire.bench._kernels import kernel_label

    fused = "void fused<unsigned short, 3, 2>(unsigned char const*, long long const*, int)"
    assert kernel_label(fused) == "fused mma, 3 ch"
    assert kernel_label("void fused<float, 4, 0>(unsigned char const*)") == "fused general, 4 ch"
    assert kernel_label("void fused<unsigned int, 1, 3>()") == "fused mixed, 1 ch"
    assert kernel_label("void resize_pass1<unsigned char>(int)") == "resize_pass1"


def test_the_hbm_floor_is_the_devices_own_bandwidth() -> None:
    from mmwire.bench._kernels import hbm_bytes_per_s

    measured = 1.23e12
    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3", measured)[0] == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe", measured)[0] == 2.0e12
    assert hbm_bytes_per_s("NVIDIA H200", measured)[0] == 4.8e12
    assert hbm_bytes_per_s("NVIDIA RTX 6000 Ada Generation", measured) == (
        measured,
        "device-to-device copy",
    )


def test_capacity_search_finds_the_last_rate_within_the_bound() -> None:
    from mmwire.bench._capacity import _search

    limit = 37.0  # a way whose p99 passes the bound above 37 req/s

    def cell(rate: float) -> dict[str, Any]:
        return {"rate": rate, "ttft_s": [0.5 if rate <= limit else 2.0] * 5}

    rate, rows = _search(cell, 5.0, 1.0)
    assert [r["rate"] for r in rows] == [5.0, 10.0, 20.0, 40.0, 30.0, 35.0]
    assert [r["within_bound"] for r in rows] == [True, True, True, False, True, True]
    assert rate == 35.0  # doubled past the limit, then the gap 20..40 halved twice
    never, rows = _search(lambda rate: {"ttft_s": [9.0]}, 5.0, 1.0)
    assert never == 0.0 and len(rows) == 1  # not even the first rate: no search below it


def test_capacity_runs_two_frontends_into_a_rank_that_reads_both(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "r"), "pipeline", "--capacity", "1", "--requests", "2"]
    args += ["--max-megapixels", "1"]
    assert main([*args, "--frontends", "2", "--ranks", "1", "--cell-seconds", "0.5"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    data = json.loads((run / "results.json").read_text())
    assert {(r["frontends"], r["mode"]) for r in data["results"]} == {
        (2, m) for m in ("eager", "raw", "encoded")
    }
    assert data["cell_s"] == 0.5
    for r in data["results"]:  # no way meets 1 ms: every cell ran, was refused, and said so
        assert r["sustained_rps"] == 0.0 and len(r["cells"]) == 1
        assert all(len(c["ttft_s"]) >= 2 and not c["within_bound"] for c in r["cells"])
    assert "sustainable rate" in (run / "table.txt").read_text()


def test_the_demo_ranks_paths_and_shares_a_place_within_ten_percent() -> None:
    from mmwire.bench._demo import ranking

    assert ranking({"mmwire": 300.0, "oob": 400.0, "segment": 410.0, "pickle": 700.0}) == {
        "mmwire": "1",
        "oob": "2=",
        "segment": "2=",
        "pickle": "4",
    }
    assert ranking({"a": 100.0, "b": 109.0, "c": 118.0}) == {"a": "1=", "b": "1=", "c": "1="}
    assert ranking({"a": 100.0, "b": 111.0}) == {"a": "1", "b": "2"}


def test_video_ships_the_container_and_decodes_only_the_sampled_frames(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "r"), "video", "--seconds", "4", "--heights", "144"]
    assert main([*args, "--reps", "1"]) == 0
    (run,) = (tmp_path / "r").iterdir()
    (row,) = json.loads((run / "results.json").read_text())["rows"]
    assert (row["frames"], row["sampled"], row["height"]) == (120, 8, 144)
    # the container < the sampled frames < the eager fp32 rows
    assert row["bytes_container"] * 5 < row["bytes_frames"] < row["bytes_fp32"]
    assert all(row[k] > 0 for k in ("probe_s", "decode_s", "pixels_s", "full_rgb_s", "full_s"))
    assert "frontend" in (run / "table.txt").read_text()
