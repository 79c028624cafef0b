"""The options every command shares, defined once: ``--json``, ``--url``, ``--token``, ``--vc``.

Why one module: a user who learns ``--url`` on ``topics list`` must find it,
spelled and meaning the same, on ``produce``, ``groups describe`` or
``tokens create``.  Every command that talks to the metadata service takes
the three service options from here, and every command takes ``JsonOption``:
``--json`` always means machine-readable output of the command, never an
input format.  A flag overrides its ``XINFRA_*`` setting, which overrides the
stack ``xinfra up`` recorded (``xinfra.settings``).

``-v`` is not a short name of ``--vc``: Kafka's tools and most shells' users
read ``-v`` as "verbose".
"""

from __future__ import annotations

from typing import Annotated

import typer

JsonOption = Annotated[
    bool, typer.Option("--json", help="Machine-readable output: JSON on stdout.")
]
UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Metadata service URL (default: XINFRA_METADATA_URL, else the "
        "stack `xinfra up` started).",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", help="API token (default: XINFRA_TOKEN, else the local stack's)."),
]
VcOption = Annotated[
    str | None,
    typer.Option("--vcluster", "--vc", help="Virtual cluster (default: XINFRA_VIRTUAL_CLUSTER)."),
]


def vc_name(value: str | None) -> str:
    """The virtual cluster a command addresses: ``--vc``, else the ``XINFRA_VIRTUAL_CLUSTER`` setting."""
    from xinfra.settings import get_settings

    return value or get_settings().virtual_cluster
