"""The shape every benchmark prints as its last line (DESIGN.md §9), and how a timed block runs.

{"bench": NAME, "machine": {...}, "figures": {NAME: number}, "targets": {NAME: {value, target, op, met}}}
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def machine(**extra: Any) -> dict[str, Any]:
    """What the figures were measured on; ``extra`` adds versions of the peers in the run."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **extra,
    }


def target(value: float, goal: float, op: str = ">=") -> dict[str, Any]:
    met = value >= goal if op == ">=" else value <= goal
    return {"value": round(value, 3), "target": goal, "op": op, "met": bool(met)}


def emit(
    bench: str, figures: dict[str, Any], targets: dict[str, Any], **machine_extra: Any
) -> None:
    """Print the one JSON object, last."""
    print(
        json.dumps(
            {
                "bench": bench,
                "machine": machine(**machine_extra),
                "figures": figures,
                "targets": targets,
            }
        ),
        flush=True,
    )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Move every object alive now out of the collector's reach for the timed block.

    A bench holds its inputs (hundreds of thousands of prepared records) for
    the whole run; without this, each full collection during a timed loop
    rescans them, and which loop pays for it depends on where the collector's
    thresholds fall.  Objects the timed code allocates are still collected as
    usual, so a path that makes more garbage still pays for it.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
