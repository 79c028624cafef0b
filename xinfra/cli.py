"""The ``xinfra`` command line: nouns then verbs, ``--json`` everywhere, exit codes that mean something.

Exit codes (``xinfra.commands.output.exit_code``): 0 success, 1 operation
failed, 2 usage error (Typer's), 3 metadata service unreachable, 4 a physical
cluster unreachable.  Subcommands that live in other packages (``northguard``,
``serve``, ``db``, ...) are mounted from the ``xinfra.commands`` entry-point
group, so this package imports none of them (DESIGN.md §1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from xinfra import __version__

COMMANDS_GROUP = "xinfra.commands"
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
PLUGIN_HELP = {
    "northguard": "Northguard: run a broker.",
    "serve": "Run the metadata service.",
    "db": "The metadata service's database: migrations.",
    "clusters": "Physical clusters: register, list, describe, delete.",
    "topics": "Virtual topics and their epochs.",
    "groups": "Consumer groups: members, assignments, checkpoints.",
    "migrate": "Move a virtual topic to another physical cluster.",
    "demo": "Demonstrations on the local stack.",
    "vclusters": "Virtual clusters: list, create.",
    "tokens": "API tokens: list, create, revoke.",
    "clients": "Connected producers and consumers: list.",
    "produce": "Produce stdin (lines or JSON) to a virtual topic.",
    "consume": "Consume virtual topics through their epochs to stdout.",
}
"""One line per plugin for ``xinfra --help``, so that the listing imports none of them."""


@cache
def _plugins() -> dict[str, EntryPoint]:
    return {entry.name: entry for entry in entry_points(group=COMMANDS_GROUP)}


def _err() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _unavailable(name: str, reason: str) -> Callable[[], None]:
    def command() -> None:
        _err().print(f"[red]xinfra {name} is not available in this install: {reason}[/red]")
        raise typer.Exit(1)

    return command


def _load_plugin(name: str) -> Any:
    """The click command of one plugin, imported now (and only now)."""
    try:
        loaded = _plugins()[name].load()
    except ImportError as error:
        # A command whose package is absent from this install: say so only when asked for.
        loaded = _unavailable(name, str(error))
    if isinstance(loaded, typer.Typer):
        group = typer.main.get_group(loaded)
        group.name = name
        return group
    single = typer.Typer()
    single.command(name)(loaded)
    return typer.main.get_command(single)


class PluginGroup(TyperGroup):
    """The top-level group: built-in commands, plus plugins imported only when invoked.

    ``xinfra --help`` lists plugins from their entry-point names and
    ``PLUGIN_HELP``, so neither it nor ``xinfra version`` imports the service,
    the brokers or the SDK.
    """

    _listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        builtins = super().list_commands(ctx)
        return builtins + sorted(n for n in _plugins() if n not in builtins)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in _plugins():
            return command
        if self._listing:
            return TyperCommand(name=cmd_name, help=PLUGIN_HELP.get(cmd_name, "A plugin command."))
        command = _load_plugin(cmd_name)
        self.commands[cmd_name] = command
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def installed_commands(names: tuple[str, ...] = ("northguard", "serve")) -> set[str]:
    """Which of ``names`` are installed and importable (what ``xinfra up`` can start)."""
    found = set()
    for name in names:
        entry = _plugins().get(name)
        if entry is None:
            continue
        try:
            entry.load()
        except ImportError:
            continue
        found.add(name)
    return found


app = typer.Typer(
    name="xinfra",
    help="Xinfra: virtual topics over Kafka and Northguard.",
    cls=PluginGroup,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # a usage error is one plain line, never a box wrapped at 80 columns
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def _main(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Xinfra: virtual topics over Kafka and Northguard."""


@app.command()
def version(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print the version."""
    print(f'{{"version": "{__version__}"}}' if as_json else __version__)


@app.command()
def up(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON events on stdout.")] = False,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated components to run: zookeeper, kafka, northguard, "
            "metadata-service (default: all installed).",
        ),
    ] = None,
) -> None:
    """Run the local stack: ZooKeeper, Kafka, Northguard, the metadata service. Ctrl-C stops it."""
    from rich.markup import escape

    from xinfra.settings import get_settings
    from xinfra.up import COMPONENT_KINDS, run_up

    chosen: set[str] | None = None
    if only is not None:
        chosen = {part.strip() for part in only.split(",") if part.strip()}
        unknown = chosen - set(COMPONENT_KINDS)
        if unknown or not chosen:
            raise typer.BadParameter(
                f"unknown components {sorted(unknown)}; choose from {', '.join(COMPONENT_KINDS)}",
                param_hint="--only",
            )
    err = _err()
    code = run_up(
        get_settings(),
        installed_commands=installed_commands(),
        as_json=as_json,
        progress=lambda message: err.print(
            f"[bold cyan]xinfra up[/bold cyan] {escape(message)}", soft_wrap=True
        ),
        only=chosen,
    )
    raise typer.Exit(code)


RunDirOption = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="The stack's run directory (default: XINFRA_RUN_DIR, else the last stack "
        "`xinfra up` started, else ./.xinfra).",
    ),
]


@app.command()
def status(
    run_dir: RunDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the local stack: what runs, pids, URLs, health. Exit 1 when it does not run."""
    from xinfra.services.state import status as stack_status
    from xinfra.settings import get_settings

    err = _err()

    report = stack_status((run_dir or get_settings().run_dir).resolve())
    if as_json:
        print(json.dumps(report))
    elif not report["running"]:
        err.print(f"no stack runs from {report['run_dir']}")
    else:
        print(f"stack of {report['run_dir']} (supervisor pid {report['supervisor_pid']})")
        for c in report["components"]:
            health = {True: "healthy", False: "UNHEALTHY", None: "-"}[c["healthy"]]
            pid = "reused" if c.get("reused") else c.get("pid") or "-"
            extra = "".join(f" {k}={c[k]}" for k in ("health_url", "metrics_url") if k in c)
            print(f"  {c['name']:<18} {c.get('url', ''):<28} pid {pid!s:<8} {health}{extra}")
    if not report["running"]:
        raise typer.Exit(1)


@app.command()
def down(
    run_dir: RunDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Stop the local stack that `xinfra up` runs (from any shell). Exit 1 when none runs."""
    from xinfra.services.state import down as stack_down
    from xinfra.settings import get_settings

    err = _err()

    report = stack_down((run_dir or get_settings().run_dir).resolve())
    if as_json:
        print(json.dumps(report))
    elif report["stopped"]:
        killed = f"; killed left-overs: {', '.join(report['killed'])}" if report["killed"] else ""
        err.print(f"stopped the stack of {report['run_dir']}{killed}")
    else:
        err.print(f"no stack runs from {report['run_dir']}")
    if not report["stopped"]:
        raise typer.Exit(1)


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="Benchmark name: a script in bench/ without .py.")],
    quick: Annotated[bool, typer.Option("--quick", help="Reduced size, under a minute.")] = False,
) -> None:
    """Run a benchmark from bench/; its last line of output is one JSON object."""
    script = BENCH_DIR / f"{name}.py"
    if not script.is_file():
        available = sorted(p.stem for p in BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []
        _err().print(
            f"[red]no benchmark {name!r}; available: {', '.join(available) or 'none'}[/red]"
        )
        raise typer.Exit(2)
    raise typer.Exit(
        subprocess.call([sys.executable, str(script), *(["--quick"] if quick else [])])
    )


def main() -> None:
    # `xinfra version` and `--version` answer before Typer builds its parameter converters
    # (which import pydantic): scripts call them often and they must stay instant.
    args = sys.argv[1:]
    if args in (["version"], ["--version"]):
        print(__version__)
        return
    if args == ["version", "--json"]:
        print(json.dumps({"version": __version__}))
        return
    app()


if __name__ == "__main__":
    main()
