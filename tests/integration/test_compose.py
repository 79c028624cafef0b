"""The production-like stack file parses and names real, pinned images.

No Docker engine runs here; ``docker-compose config`` (Debian's v1) validates the
file without one.  ``.ci/run`` installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose_config() -> dict:  # type: ignore[type-arg]
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(
            "docker-compose is not installed: `apt-get install docker-compose` (.ci/run does)"
        )
    # The file refuses to render without its secrets (docs/security.md): give it stand-ins.
    env = {
        **os.environ,
        "XINFRA_ADMIN_TOKEN": "x" * 40,
        "XINFRA_NORTHGUARD_SECRET": "n" * 40,
        "MYSQL_ROOT_PASSWORD": "x" * 20,
        "XINFRA_DB_PASSWORD": "x" * 20,
        "XINFRA_COUCHBASE_PASSWORD": "x" * 20,
    }
    subprocess.run(
        [binary, "config", "-q"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60
    )
    rendered = subprocess.run(
        [binary, "config"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    import yaml  # PyYAML comes with uvicorn[standard]

    return yaml.safe_load(rendered)  # type: ignore[no-any-return]


def test_compose_has_the_production_services(compose_config: dict) -> None:  # type: ignore[type-arg]
    services = compose_config["services"]
    assert {"mysql", "zookeeper", "kafka", "couchbase", "metadata-service"} <= services.keys()
    assert {"northguard-1", "northguard-2", "northguard-3"} <= services.keys()
    racks = {
        " ".join(services[f"northguard-{i}"]["command"]).split("rack=")[1].split()[0]
        for i in (1, 2, 3)
    }
    assert racks == {"r1", "r2", "r3"}, "each broker on its own rack attribute"


def _option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_northguard_brokers_form_one_cluster_with_replication_factor_3(
    compose_config: dict,
) -> None:  # type: ignore[type-arg]
    services = compose_config["services"]
    commands = {
        i: [str(part) for part in services[f"northguard-{i}"]["command"]] for i in (1, 2, 3)
    }
    assert "--cluster" in commands[1] and _option(commands[1], "--coordinator") is None
    for i in (2, 3):  # members join the coordinator, after it answers
        assert _option(commands[i], "--coordinator") == "northguard-1:9470"
        assert "--cluster" not in commands[i]
        assert "northguard-1" in services[f"northguard-{i}"]["depends_on"]
    for i, command in commands.items():
        assert _option(command, "--replication-factor") == "3"
        assert _option(command, "--id") == str(i)
        # Peers and clients reach each broker by its compose name, never 0.0.0.0.
        assert _option(command, "--advertised-address") == f"northguard-{i}:9470"
    bootstrap = services["metadata-service"]["environment"]["XINFRA_NORTHGUARD_BOOTSTRAP"]
    assert bootstrap.split(",") == [f"northguard-{i}:9470" for i in (1, 2, 3)]


def test_third_party_images_are_pinned(compose_config: dict) -> None:  # type: ignore[type-arg]
    for name, service in compose_config["services"].items():
        image = service.get("image", "")
        if image.startswith("xinfra"):
            assert "build" in service, f"{name} uses the project image and must build it"
            continue
        assert ":" in image and not image.endswith(":latest"), (
            f"{name}: image {image!r} is not pinned"
        )


def test_kafka_runs_in_kraft_mode(compose_config: dict) -> None:  # type: ignore[type-arg]
    environment = compose_config["services"]["kafka"]["environment"]
    assert environment["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "zookeeper" not in json.dumps(environment).lower()


def test_northguard_brokers_require_the_secret_the_service_signs_with(compose_config: dict) -> None:  # type: ignore[type-arg]
    services = compose_config["services"]
    for i in (1, 2, 3):
        assert services[f"northguard-{i}"]["environment"]["XINFRA_NORTHGUARD_SECRET"] == "n" * 40
    assert services["metadata-service"]["environment"]["XINFRA_NORTHGUARD_SECRET"] == "n" * 40
    # The registration holds a reference the service resolves, never the secret itself.
    registration = " ".join(services["clusters-init"]["command"])
    assert "northguard.secret=env:XINFRA_NORTHGUARD_SECRET" in registration
    assert "n" * 40 not in registration


def test_compose_refuses_to_start_without_a_northguard_secret() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    env = {
        **{k: v for k, v in os.environ.items() if k != "XINFRA_NORTHGUARD_SECRET"},
        "XINFRA_ADMIN_TOKEN": "x" * 40,
        "MYSQL_ROOT_PASSWORD": "x" * 20,
        "XINFRA_DB_PASSWORD": "x" * 20,
        "XINFRA_COUCHBASE_PASSWORD": "x" * 20,
    }
    refused = subprocess.run(
        [binary, "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0
    assert "XINFRA_NORTHGUARD_SECRET" in refused.stderr
