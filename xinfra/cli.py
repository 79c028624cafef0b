"""The ``xinfra`` command line: nouns then verbs, ``--json`` everywhere, exit codes that mean something.

Exit codes: 0 success, 1 operation failed, 2 usage error (Typer's), 3 service
unreachable.  Subcommands that live in other packages (``northguard``,
``serve``, ``db``, ...) are mounted from the ``xinfra.commands`` entry-point
group, so this package imports none of them (DESIGN.md §1).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from xinfra import __version__
from xinfra.settings import get_settings

app = typer.Typer(
    name="xinfra",
    help="Xinfra: virtual topics over Kafka and Northguard.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

COMMANDS_GROUP = "xinfra.commands"
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def _unavailable(name: str, reason: str) -> Callable[[], None]:
    def command() -> None:
        err.print(f"[red]xinfra {name} is not available in this install: {reason}[/red]")
        raise typer.Exit(1)

    return command


def _mount_plugins() -> set[str]:
    """Mount every installed subcommand; return their names."""
    mounted: set[str] = set()
    for entry in entry_points(group=COMMANDS_GROUP):
        try:
            command = entry.load()
        except ImportError as error:
            # A command whose package is absent from this install: say so only when asked for.
            app.command(entry.name, hidden=True)(_unavailable(entry.name, str(error)))
            continue
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=entry.name)
        else:
            app.command(entry.name)(command)
        mounted.add(entry.name)
    return mounted


@app.command()
def version(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print the version."""
    print(f'{{"version": "{__version__}"}}' if as_json else __version__)


@app.command()
def up(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON events on stdout.")] = False,
) -> None:
    """Run the local stack: ZooKeeper, Kafka, Northguard, the metadata service. Ctrl-C stops it."""
    from xinfra.up import run_up

    code = run_up(
        get_settings(),
        installed_commands=MOUNTED,
        as_json=as_json,
        progress=lambda message: err.print(f"[bold cyan]xinfra up[/bold cyan] {message}"),
    )
    raise typer.Exit(code)


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="Benchmark name: a script in bench/ without .py.")],
    quick: Annotated[bool, typer.Option("--quick", help="Reduced size, under a minute.")] = False,
) -> None:
    """Run a benchmark from bench/; its last line of output is one JSON object."""
    script = BENCH_DIR / f"{name}.py"
    if not script.is_file():
        available = sorted(p.stem for p in BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []
        err.print(f"[red]no benchmark {name!r}; available: {', '.join(available) or 'none'}[/red]")
        raise typer.Exit(2)
    raise typer.Exit(
        subprocess.call([sys.executable, str(script), *(["--quick"] if quick else [])])
    )


MOUNTED = _mount_plugins()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
