"""Errors keep stable codes across the wire; models validate at the boundary."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xinfra import errors
from xinfra.keyspace import shard_ranges
from xinfra.model import (
    ClusterKind,
    Epoch,
    EpochState,
    PhysicalCluster,
    Record,
    Shard,
    TopicMetadata,
    VirtualTopic,
)
from xinfra.names import check_name


def test_every_error_code_is_unique_and_round_trips() -> None:
    seen: dict[str, type[errors.XinfraError]] = {}

    def walk(cls: type[errors.XinfraError]) -> None:
        if seen.get(cls.code) is cls:
            return  # reached again through its other base (BackendTimeout: a Timeout too)
        assert cls.code not in seen, (
            f"{cls.__name__} reuses code {cls.code} of {seen.get(cls.code)}"
        )
        seen[cls.code] = cls
        for sub in cls.__subclasses__():
            walk(sub)

    walk(errors.XinfraError)
    for code, cls in seen.items():
        rebuilt = errors.error_from_code(code, "what happened")
        assert type(rebuilt) is cls
        assert str(rebuilt) == f"what happened [{code}]"
    assert type(errors.error_from_code("no-such-code", "x")) is errors.XinfraError


def test_retriable_errors_are_the_unavailable_family_and_storage() -> None:
    assert errors.BackendUnavailable("x").retriable
    assert errors.NotLeader("x").retriable
    assert not errors.TopicNotFound("x").retriable
    assert not errors.CorruptData("x").retriable
    assert errors.TopicNotFound.http_status == 404 and errors.VersionConflict.http_status == 409


@pytest.mark.parametrize("name", ["orders", "a", "Orders.v2_eu-west", "9lives", "x" * 200])
def test_valid_names(name: str) -> None:
    assert check_name(name) == name
    VirtualTopic(virtual_cluster="default", name=name)


@pytest.mark.parametrize(
    "name", ["", ".hidden", "-x", "has space", "slash/no", "x" * 201, "ünicode"]
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        check_name(name)
    with pytest.raises(ValidationError):
        VirtualTopic(virtual_cluster="default", name=name)


def _metadata() -> TopicMetadata:
    shards = [Shard(index=i, key_range=r) for i, r in enumerate(shard_ranges(3))]
    return TopicMetadata(
        topic=VirtualTopic(virtual_cluster="vc", name="orders"),
        version=4,
        epochs=[
            Epoch(
                number=0,
                cluster="k",
                physical_topic="orders-0",
                shards=shards,
                state=EpochState.SEALED,
                end_offsets={0: 5, 1: 0, 2: 9},
            ),
            Epoch(
                number=1,
                cluster="ng",
                physical_topic="orders-1",
                shards=shards,
                state=EpochState.ACTIVE,
            ),
        ],
        clusters={
            "k": PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap="127.0.0.1:9092"),
            "ng": PhysicalCluster(
                name="ng", kind=ClusterKind.NORTHGUARD, bootstrap="127.0.0.1:9470"
            ),
        },
    )


def test_topic_metadata_json_round_trip_keeps_2_to_the_64() -> None:
    metadata = _metadata()
    document = metadata.model_dump(mode="json")
    assert document["epochs"][0]["shards"][2]["key_range"][1] == str(2**64)
    assert TopicMetadata.model_validate(document) == metadata
    assert TopicMetadata.model_validate_json(metadata.model_dump_json()) == metadata


def test_write_epochs_are_the_unsealed_ones_oldest_first() -> None:
    metadata = _metadata()
    assert metadata.current_epoch.number == 1
    assert [e.number for e in metadata.write_epochs] == [1]


def test_record_size_counts_key_value_and_headers() -> None:
    assert Record(value=b"12345", key=b"ab", headers=(("h", b"xyz"),)).size_bytes() == 11
    assert Record(value=None).size_bytes() == 0


def test_a_renamed_setting_is_refused_with_its_new_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old single-broker name would otherwise be ignored and the stack start elsewhere."""
    from xinfra.settings import Settings

    monkeypatch.setenv("XINFRA_NORTHGUARD_HTTP_PORT", "9471")
    with pytest.raises(ValueError, match="XINFRA_NORTHGUARD_HTTP_PORTS"):
        Settings()
    monkeypatch.setenv("XINFRA_NORTHGUARD_HTTP_PORTS", "9471,9473,9475")
    assert Settings().northguard_http_ports == "9471,9473,9475"
