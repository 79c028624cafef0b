"""How long the command line takes to answer: ``xinfra version``, ``--version`` and ``--help``.

Every figure is the wall time of a fresh process (``python -m xinfra.cli ...``,
what the ``xinfra`` script runs), from spawn to exit, stdout read; the floor is
the interpreter alone (``python -c pass``), measured in the same rounds so the
figures can be read against what Python itself costs on this machine.  Each
round runs every side ``--runs`` times in an order rotated per round and keeps
each side's median; the figures are the medians over rounds, with min and max.

Target (issue 16): ``xinfra version`` and ``xinfra --help`` under 0.3 s median.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Rounds, alternating, bench_parser, finish, guard, rounds_of, target

SIDES = {
    "version_s": ["-m", "xinfra.cli", "version"],
    "version_flag_s": ["-m", "xinfra.cli", "--version"],
    "help_s": ["-m", "xinfra.cli", "--help"],
    "python_floor_s": ["-c", "pass"],
}
TARGET_S = 0.3


def once(args: list[str]) -> float:
    """One fresh process; its output is checked so that a crash is not a fast answer."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100"},
        check=False,
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 0 or (args[0] == "-m" and not result.stdout.strip()):
        raise RuntimeError(f"{args} failed ({result.returncode}): {result.stderr[-500:]}")
    return elapsed


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--runs", type=int, default=0, help="runs per side per round (default 15)")
    args = parser.parse_args()
    runs = args.runs or (5 if args.quick else 15)
    rounds = Rounds()
    for order in alternating(rounds_of(args), list(SIDES)):
        for side in order:
            once(SIDES[side])  # warm the page cache for this side
            rounds.add(side, statistics.median(once(SIDES[side]) for _ in range(runs)))
    figures = rounds.figures()
    targets = {
        "version_s": target(figures["version_s"], TARGET_S, "<="),
        "help_s": target(figures["help_s"], TARGET_S, "<="),
    }
    finish(
        "cli",
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "runs_per_round": runs,
            "rounds": rounds_of(args),
            "python": sys.version.split()[0],
        },
    )


if __name__ == "__main__":
    guard("cli", main)
