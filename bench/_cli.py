"""``mmwire-bench``: entry point of the benchmark harness."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen benchmark."""
    parser = argparse.ArgumentParser(prog="mmwire-bench", description=__doc__)
    parser.parse_args(argv)
    return 0
