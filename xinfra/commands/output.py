"""Shared output and error handling of the subcommands, and the one map from errors to exit codes.

Exit codes (README): 0 done, 1 the operation failed, 2 usage (Typer's),
3 the metadata service is unreachable, 4 a physical cluster (Kafka,
Northguard) is unreachable.  ``exit_code`` is the only place that maps an
error to one; ``exit_codes`` and ``service_call`` apply it, so the SDK's
commands (``produce``, ``consume``) and the HTTP ones agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import typer
from rich.console import Console
from rich.markup import escape

from xinfra.errors import BackendUnavailable, Unauthenticated, Unavailable, XinfraError
from xinfra.rest import MetadataClient

err = Console(stderr=True)
out = Console()

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_SERVICE_UNREACHABLE: Final = 3
EXIT_CLUSTER_UNREACHABLE: Final = 4
EXIT_INTERRUPTED: Final = 130


def exit_code(error: XinfraError) -> int:
    """The exit code of a command that failed with ``error``.

    Why the distinction: a script retries an unreachable service or cluster
    (3, 4) and gives up on a refused operation (1).  ``BackendUnavailable`` is
    what the backends and the SDK raise, and what the service reports (503
    ``backend_unavailable``), when a physical cluster does not answer; every
    other ``Unavailable`` is the metadata service's.
    """
    if isinstance(error, BackendUnavailable):
        return EXIT_CLUSTER_UNREACHABLE
    if isinstance(error, Unavailable):
        return EXIT_SERVICE_UNREACHABLE
    return EXIT_FAILED


def hint(error: XinfraError) -> str:
    """What to set or check when that is the fix: the settings and the commands, by name."""
    from xinfra.services.state import user_config_path

    if isinstance(error, Unauthenticated):
        return (
            "no valid token: set XINFRA_TOKEN (or pass --token), or start the local stack with "
            f"`xinfra up`, which records its token file in {user_config_path()}"
        )
    if isinstance(error, BackendUnavailable):
        return (
            "a physical cluster does not answer: is it running? `xinfra status` shows the local "
            "stack, `xinfra clusters list` the registered clusters"
        )
    if isinstance(error, Unavailable):
        return (
            "is the metadata service running? `xinfra status` shows the local stack; set "
            "XINFRA_METADATA_URL (or pass --url) for another service"
        )
    return ""


def error_line(error: XinfraError) -> str:
    """One line: the message, the stable code, and what to set when that is the fix."""
    extra = hint(error)
    return f"{error.message} [{error.code}]" + (f"; {extra}" if extra else "")


@contextmanager
def exit_codes() -> Iterator[None]:
    """Xinfra errors become one red line on stderr and the exit code ``exit_code`` names."""
    try:
        yield
    except XinfraError as error:
        err.print(f"[red]{escape(error_line(error))}[/red]", soft_wrap=True)
        raise typer.Exit(exit_code(error)) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


@contextmanager
def service_call(url: str | None = None, token: str | None = None) -> Iterator[MetadataClient]:
    """A client of the service at ``url`` (``--url``) with ``token`` (``--token``); errors as
    ``exit_codes``.  ``None`` falls back to the settings (``XINFRA_METADATA_URL``, ...)."""
    with exit_codes(), MetadataClient(url, token=token) as client:
        yield client


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """``data`` as one JSON document on stdout with ``--json``, else as ``human`` prints it."""
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human(data)
