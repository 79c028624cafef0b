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

from xinfra.errors import Unavailable, XinfraError
from xinfra.rest import MetadataClient

err = Console(stderr=True)
out = Console()


@contextmanager
def service_call() -> Iterator[MetadataClient]:
    """A client; service errors become a red message and a meaningful exit code."""
    try:
        with MetadataClient() as client:
            yield client
    except Unavailable as error:
        err.print(f"[red]{escape(error.message)}[/red]")
        raise typer.Exit(3) from None
    except XinfraError as error:
        err.print(f"[red]{escape(error.message)} {escape(f'[{error.code}]')}[/red]")
        raise typer.Exit(1) from None


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        print(json.dumps(data, default=str))
    else:
        human(data)
