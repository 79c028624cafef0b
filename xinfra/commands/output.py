"""Shared output and error handling of the HTTP-backed subcommands.

Exit codes follow ``xinfra.cli``: 0 success, 1 the operation failed, 3 the
service is unreachable.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from xinfra.errors import BackendUnavailable, Unauthenticated, Unavailable, XinfraError
from xinfra.rest import MetadataClient

err = Console(stderr=True)
out = Console()


def hint(error: XinfraError) -> str:
    """What to set when the service or the token was not found: the settings, by name."""
    from xinfra.services.state import user_config_path

    if isinstance(error, Unauthenticated):
        return (
            "no valid token: set XINFRA_TOKEN (or pass --token), or start the local stack with "
            f"`xinfra up`, which records its token file in {user_config_path()}"
        )
    if isinstance(error, Unavailable) and not isinstance(error, BackendUnavailable):
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
def service_call() -> Iterator[MetadataClient]:
    """A client; service errors become a red message and a meaningful exit code."""
    try:
        with MetadataClient() as client:
            yield client
    except Unavailable as error:
        err.print(f"[red]{escape(error_line(error))}[/red]", soft_wrap=True)
        raise typer.Exit(3) from None
    except XinfraError as error:
        err.print(f"[red]{escape(error_line(error))}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human(data)
