"""Where results go: a folder per run with the raw JSON, the tables and a plot.

By default under ``./mmwire-results/<date>-<time>-<name>/`` (or ``--out``), which nothing
tracks. ``--record``, from a checkout's root, updates the project's record instead:
``bench/results/<name>-<machine class>/`` holds the latest run of each benchmark on each
class of machine, and ``bench/RESULTS.md`` is regenerated from it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = [
    "DEFAULT_OUT",
    "RECORD_DIR",
    "bar_plot",
    "machine",
    "machine_class",
    "percentile",
    "regenerate_index",
    "write_run",
]

DEFAULT_OUT = Path("mmwire-results")
"""Where a run goes unless told otherwise (relative to the working directory)."""
RECORD_DIR = Path("bench") / "results"
"""The project's record of the latest run per benchmark and machine class (``--record``)."""


def _commit() -> str:
    if os.environ.get("MMWIRE_COMMIT"):  # set where the tree travels without .git (GPU machine)
        return os.environ["MMWIRE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
        )
        dirty = subprocess.run(  # the harness's own outputs do not make the code dirty
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ":/",
                ":(top,exclude)bench/RESULTS.md",
                ":(top,exclude)bench/results",
                ":(top,exclude)mmwire-results",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
        ).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """What ran the benchmark: host, CPUs, Python, libraries, GPU if any."""
    import numpy
    import PIL
    import torch
    import zmq

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "pillow": PIL.__version__,
        "pyzmq": zmq.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        info["cpu_model"] = None
    return info


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bar_plot(
    labels: list[str], series: dict[str, list[float]], ylabel: str, *, log: bool = True
) -> Any:
    """A grouped bar chart writer for ``write_run(plot=...)``: one group per label."""

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4))
        width = 0.8 / max(len(series), 1)
        for k, (name, values) in enumerate(series.items()):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, values, width, label=name)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


def machine_class(meta: dict[str, Any]) -> str:
    """A run's class of machine, for the record: its GPU, else its CPU count."""
    if meta.get("gpu"):
        return re.sub(r"[^a-z0-9]+", "-", str(meta["gpu"]).lower()).strip("-")
    return f"cpu{meta.get('cpus')}"


def _is_record(root: Path) -> bool:
    return root.resolve() == RECORD_DIR.resolve()


def write_run(
    name: str,
    payload: dict[str, Any],
    table: Table,
    plot: Any = None,
    out_dir: Path | None = None,
    extra_tables: Sequence[Table] = (),
) -> Path:
    """Write ``results.json``, ``table.txt`` (the tables, 120 columns wide) and ``plot.png``
    for one run, into ``out_dir`` (``DEFAULT_OUT``); into ``RECORD_DIR`` it replaces the
    previous run of the same benchmark and machine class and regenerates the index."""
    root = out_dir or DEFAULT_OUT
    meta = payload.setdefault("machine", machine())
    if _is_record(root):
        folder = root / f"{name}-{machine_class(meta)}"
        shutil.rmtree(folder, ignore_errors=True)
    else:
        stamp = meta["date"][:19].replace(":", "").replace("-", "")
        folder = root / f"{stamp[:8]}-{stamp[9:15]}-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(payload, indent=1, default=float))
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=120, file=sink)
        for t in (*extra_tables, table):
            t.box = box.SIMPLE_HEAD  # the file's tables: light rules, plain-text friendly
            console.print(t)
        (folder / "table.txt").write_text(console.export_text())
    if plot is not None:
        try:
            plot(folder / "plot.png")
        except ImportError:
            pass  # the JSON and table are the record; the plot needs mmwire[plot]
    if _is_record(root):
        regenerate_index(root)
    return folder


def regenerate_index(root: Path | None = None) -> Path:
    """Rebuild ``bench/RESULTS.md`` from the record: one section per benchmark and machine
    class, its latest table, and what ran it."""
    root = root or RECORD_DIR
    lines = [
        "# mmwire benchmark results",
        "",
        "Generated by `mmwire-bench --record` from `bench/results/`: the latest run of each",
        "benchmark on each class of machine. Every sample is in the run's `results.json`.",
        "",
    ]
    for path in sorted(root.glob("*/results.json")):
        data = json.loads(path.read_text())
        m = data.get("machine", {})
        lines += [  # no blank line before a heading: the index stays under 150 lines
            f"## {path.parent.name}: {str(m.get('date'))[:10]} · {m.get('cpus')} CPUs "
            f"({m.get('cpu_model')}) · GPU: {m.get('gpu') or 'none'} · commit `{m.get('commit')}`",
        ]
        table = path.parent / "table.txt"
        if table.exists():  # without the tables' blank padding lines
            rows = [ln.rstrip() for ln in table.read_text().splitlines() if ln.strip()]
            lines += ["```", *rows, "```"]
        if data.get("notes"):
            lines.append("Notes: " + "; ".join(data["notes"]) + ".")
    index = root.parent / "RESULTS.md"
    index.write_text("\n".join(lines).rstrip() + "\n")
    return index
