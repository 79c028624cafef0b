"""The command line's surface: -h and --version everywhere, plugins imported only when used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xinfra import __version__


def _xinfra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xinfra.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_version_flag_and_command() -> None:
    assert _xinfra("--version").stdout.strip() == __version__
    assert _xinfra("version").stdout.strip() == __version__
    assert _xinfra("version", "--json").stdout.strip() == f'{{"version": "{__version__}"}}'


@pytest.mark.parametrize(
    "args",
    [
        ["-h"],
        ["topics", "-h"],
        ["topics", "reconcile", "-h"],
        ["topics", "offsets", "-h"],
        ["consume", "-h"],
        ["produce", "-h"],
        ["topics", "alter", "-h"],
        ["vclusters", "create", "-h"],
        ["tokens", "revoke", "-h"],
        ["clients", "list", "-h"],
        ["northguard", "broker", "-h"],
        ["status", "-h"],
        ["down", "-h"],
    ],
)
def test_short_help_everywhere(args: list[str]) -> None:
    result = _xinfra(*args)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout


def test_help_and_version_import_no_plugin() -> None:
    """The listing names every plugin, yet imports neither the service, the brokers nor the SDK."""
    probe = (
        "import sys\n"
        "from xinfra.cli import app\n"
        "for args in (['--help'], ['version'], ['--version']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('metadata_service', 'backends', 'clients', 'fastapi', 'httpx',\n"
        "                     'pydantic_settings') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout
    for plugin in ("topics", "produce", "consume", "northguard", "serve", "vclusters", "tokens"):
        assert plugin in result.stdout


def test_unknown_command_is_a_usage_error() -> None:
    result = _xinfra("nope")
    assert result.returncode == 2
    assert "nope" in result.stderr


@pytest.mark.parametrize(
    ("args", "options"),
    [
        (["topics", "list"], ["--url", "--token", "--vc", "--json"]),
        (["topics", "alter"], ["--url", "--token", "--vc", "--json"]),
        (["groups", "describe"], ["--url", "--token", "--vc", "--json"]),
        (["clusters", "list"], ["--url", "--token", "--json"]),
        (["vclusters", "list"], ["--url", "--token", "--json"]),
        (["tokens", "create"], ["--url", "--token", "--json"]),
        (["clients", "list"], ["--url", "--token", "--vc", "--json"]),
        (["produce"], ["--url", "--token", "--vc", "--json", "--input", "--base64"]),
        (["consume"], ["--url", "--token", "--vc", "--json", "--format", "--base64"]),
        (["migrate", "run"], ["--url", "--token", "--vc", "--json"]),
        (["migrate", "status"], ["--url", "--token", "--vc", "--json"]),
    ],
)
def test_service_commands_share_their_options(args: list[str], options: list[str]) -> None:
    """One spelling for each shared option on every command that talks to the service."""
    result = _xinfra(*args, "-h")
    assert result.returncode == 0, result.stderr
    for option in options:
        assert option in result.stdout, (args, option)
    assert "-v," not in result.stdout  # -v is not the virtual cluster


@pytest.mark.parametrize(
    "args",
    [
        ["topics", "add-epoch", "t", "--cluster", "c", "--state", "sealed"],
        ["tokens", "create", "t", "--role", "root"],
        ["produce", "t", "--input", "xml"],
        ["produce", "t", "--input", "json", "--key-separator", ":"],
        ["consume", "t", "--format", "%Z"],
        ["consume", "t", "--format", "50%"],
        ["consume", "t", "--format", "%v", "--json"],
        ["topics", "alter", "t"],
    ],
)
def test_closed_choices_and_bad_formats_are_usage_errors(args: list[str]) -> None:
    """Refused before any service is asked (none runs here): exit 2, one message on stderr."""
    env = {**os.environ, "XINFRA_METADATA_URL": "http://127.0.0.1:1"}
    result = subprocess.run(
        [sys.executable, "-m", "xinfra.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, (args, result.stderr)
    assert "Traceback" not in result.stderr
