"""mmwire-bench: peers' ways of moving and preparing features, and mmwire's, side by side.

With no command it runs the demo (a tokenizer and two scheduler ranks on this host, no GPU).
Each run writes its JSON (every sample), tables and plot to ./mmwire-results/<date>-<name>/,
or under --out. --record, from a mmwire checkout's root, replaces the project's record of
that benchmark on this class of machine (bench/results/) and regenerates bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from ._report import DEFAULT_OUT, RECORD_DIR


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen benchmark."""
    parser = argparse.ArgumentParser(
        prog="mmwire-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default: ./{DEFAULT_OUT})"
    )
    where.add_argument(
        "--record",
        action="store_true",
        help=f"update the project's record ({RECORD_DIR}/), from a checkout's root",
    )
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="the README demo (default)")
    demo.add_argument("--ranks", type=int, default=2)
    demo.add_argument("--reps", type=int, default=9, help="runs of each request on each path")
    tr = sub.add_parser("transport", help="payload sizes x consumers x methods")
    tr.add_argument(
        "--sizes",
        default="16K,64K,256K,1M,16M,256M",
        help="comma-separated payload sizes (K/M suffixes)",
    )
    tr.add_argument("--consumers", default="1,4", help="comma-separated rank counts")
    tr.add_argument(
        "--methods",
        default="mmwire,pickle,oob,segment,tmp_queue,vllm_mq,vllm_store,zmq_frames,mooncake_tcp,pickle_tcp",
        help="the last three reach a rank on another host (run with one rank over TCP)",
    )
    tr.add_argument("--seconds", type=float, default=2.0, help="time budget per cell")
    tr.add_argument(
        "--throughput-requests",
        type=int,
        default=2000,
        help="requests sent back to back at 64 KiB for the unpaced rate",
    )
    pre = sub.add_parser("preprocess", help="CPU preprocessing vs the reference processor's way")
    pre.add_argument("--threads", type=int, default=2)
    sub.add_parser("h2d", help="H2D from the arena, registered vs pageable (needs CUDA)")
    ker = sub.add_parser("kernels", help="CUDA pixel pipeline vs the torch way and Pillow")
    ker.add_argument("--reps", type=int, default=20)
    ker.add_argument(
        "--cases",
        default=None,
        help="comma-separated parts of case names, e.g. 'InternVL3,Gemma 3' (default: all)",
    )
    gt = sub.add_parser("gpu-transport", help="CUDA tensors between processes (needs CUDA)")
    gt.add_argument("--sizes", default="1M,16M,64M,256M")
    gt.add_argument("--reps", type=int, default=50)
    gt.add_argument("--methods", default="cuda_ipc,fabric,cpu,torch_mp,floor")
    pl = sub.add_parser("pipeline", help="Poisson arrivals, eager vs deferred preprocessing")
    pl.add_argument("--ranks", type=int, default=2)
    pl.add_argument("--requests", type=int, default=30, help="requests per (mode, rate) cell")
    pl.add_argument("--rates", default="0.5,1,2", help="multiples of eager's capacity")
    pl.add_argument(
        "--device",
        default="cpu",
        help="the owners' materializer: cpu, cuda (the CUDA kernels), or both as cpu,cuda",
    )
    pl.add_argument(
        "--capacity",
        type=float,
        metavar="P99_MS",
        help="instead, find each way's highest rate whose p99 stays within P99_MS",
    )
    pl.add_argument(
        "--max-megapixels",
        type=float,
        default=12.0,
        help="draw photos only from the sizes up to this many megapixels (0.3 to 12)",
    )
    pl.add_argument("--frontends", default="1,2", help="with --capacity: producer counts")
    pl.add_argument(
        "--cell-seconds",
        type=float,
        default=3.0,
        help="with --capacity: how long each rate is held (its requests cycle)",
    )
    vid = sub.add_parser("video", help="video items: bytes shipped and the owner's decode")
    vid.add_argument("--seconds", default="10,30", help="comma-separated clip lengths")
    vid.add_argument("--heights", default="480,720,1080", help="comma-separated heights")
    vid.add_argument("--family", default="qwen2.5-vl", help="qwen2-vl, qwen2.5-vl or qwen3-vl")
    vid.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    vid.add_argument("--reps", type=int, default=3)
    en = sub.add_parser("engine", help="reuse and the owner cache on a chat trace; async publish")
    en.add_argument("--ranks", type=int, default=2)
    en.add_argument("--conversations", type=int, default=6)
    en.add_argument("--turns", type=int, default=4)
    en.add_argument("--reps", type=int, default=300, help="publishes per async/sync cell")
    en.add_argument("--device", default="cpu", help="the owners' materializer: cpu or cuda")
    en.add_argument(
        "--max-megapixels",
        type=float,
        default=3.2,
        help="draw photos only from the sizes up to this many megapixels (0.3 to 3.2)",
    )
    args = parser.parse_args(argv)
    if args.record and getattr(args, "cases", None) is not None:
        parser.error("--record keeps a whole kernels run: leave --cases out")
    if args.record:
        if not RECORD_DIR.is_dir():
            parser.error(f"--record updates ./{RECORD_DIR}: run it from a mmwire checkout's root")
        args.out = RECORD_DIR
    command = args.command or "demo"
    # mmwire's log lines (a rank that ended, a request reported lost) go through the console
    # that draws the progress and the tables, above them, never into them
    console = Console()
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, show_time=False)],
    )
    if command == "demo":
        from ._demo import run_demo

        run_demo(
            ranks=getattr(args, "ranks", 2),
            reps=getattr(args, "reps", 9),
            out_dir=args.out,
            console=console,
        )
    elif command == "transport":
        from ._transport import run_transport

        run_transport(
            _sizes(args.sizes),
            [int(c) for c in args.consumers.split(",")],
            args.methods.split(","),
            args.seconds,
            out_dir=args.out,
            throughput_requests=args.throughput_requests,
            console=console,
        )
    elif command == "preprocess":
        from ._preprocess import run_preprocess

        run_preprocess(threads=args.threads, out_dir=args.out, console=console)
    elif command == "h2d":
        from ._h2d import run_h2d

        run_h2d(out_dir=args.out, console=console)
    elif command == "kernels":
        from ._kernels import run_kernels

        run_kernels(reps=args.reps, out_dir=args.out, console=console, cases=args.cases)
    elif command == "pipeline" and args.capacity is not None:
        from ._capacity import run_capacity

        run_capacity(
            args.ranks,
            args.requests,
            tuple(args.device.split(",")),
            args.capacity / 1e3,
            tuple(int(x) for x in args.frontends.split(",")),
            cell_s=args.cell_seconds,
            out_dir=args.out,
            console=console,
            max_megapixels=args.max_megapixels,
        )
    elif command == "pipeline":
        from ._pipeline import run_pipeline

        run_pipeline(
            args.ranks,
            args.requests,
            tuple(float(x) for x in args.rates.split(",")),
            tuple(args.device.split(",")),
            out_dir=args.out,
            console=console,
            max_megapixels=args.max_megapixels,
        )
    elif command == "engine":
        from ._engine import run_engine

        run_engine(
            args.ranks,
            args.conversations,
            args.turns,
            args.reps,
            args.device,
            out_dir=args.out,
            max_megapixels=args.max_megapixels,
        )
    elif command == "video":
        from ._video import run_video

        run_video(
            [float(x) for x in args.seconds.split(",")],
            [int(x) for x in args.heights.split(",")],
            args.family,
            args.fps,
            args.reps,
            out_dir=args.out,
            console=console,
        )
    elif command == "gpu-transport":
        from ._gpu_transport import run_gpu_transport

        run_gpu_transport(
            _sizes(args.sizes), args.reps, tuple(args.methods.split(",")), out_dir=args.out
        )
    else:
        parser.exit(2, f"mmwire-bench {command}: not implemented yet in this version\n")
    return 0


def _sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        out.append(int(part[:-1]) * units[part[-1]] if part[-1] in units else int(part))
    return out
