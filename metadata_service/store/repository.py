"""The repository: the only code that writes SQL, synchronous, one short transaction per call.

The service calls it from a bounded thread pool.  Every write is a single
transaction on one shard (one virtual cluster) or on one reference-table row,
and every update of a mutable row is a compare-and-set on its ``version``:
``UPDATE ... WHERE version = :expected`` matching no row means someone else
won, and the caller gets ``VersionConflict`` instead of a lost update.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.mysql import asyncmy as mysql_asyncmy
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from metadata_service.cluster_secrets import public_attributes
from metadata_service.store import tables as t
from xinfra.errors import (
    Backpressure,
    ClusterNotFound,
    Conflict,
    Forbidden,
    NotFound,
    TopicAlreadyExists,
    TopicNotFound,
    VersionConflict,
)
from xinfra.keyspace import KeyRange
from xinfra.model import (
    ClusterKind,
    Epoch,
    EpochState,
    PhysicalCluster,
    Shard,
    TopicMetadata,
    VirtualCluster,
)


def now_ms() -> int:
    return int(time.time() * 1000)


def make_engine(database_url: str, pool_size: int = 16) -> Engine:
    """An engine tuned per dialect: SQLite shared across threads (WAL), MySQL with a bounded pool.

    No overflow connections on MySQL: one made on demand and dropped after its request
    costs a TLS context (PyMySQL builds one per connection even when the server refuses
    TLS: 27 ms here, holding the GIL, so every request of the instance stalls), and
    under load overflow churns.  A request waits for a pooled connection instead.
    """
    if database_url.startswith("sqlite"):
        engine = sa.create_engine(
            database_url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=pool_size,
            max_overflow=0,
            poolclass=sa.pool.QueuePool,
        )

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    return sa.create_engine(
        database_url,
        pool_size=pool_size,
        max_overflow=0,
        pool_pre_ping=True,
        pool_recycle=3600,
        pool_timeout=10,
    )


@dataclass
class TopicRow:
    virtual_cluster: str
    name: str
    config: dict[str, str]
    sealed: bool
    state: str
    version: int
    updated_ms: int


@dataclass
class EpochRow:
    virtual_cluster: str
    topic: str
    number: int
    cluster: str
    physical_topic: str
    shards: list[KeyRange]
    state: EpochState = EpochState.ACTIVE
    end_offsets: dict[int, int] | None = None
    mirror_of: int | None = None
    intent: str = "ready"
    updated_ms: int = 0

    def to_model(self) -> Epoch:
        return Epoch(
            number=self.number,
            cluster=self.cluster,
            physical_topic=self.physical_topic,
            shards=[Shard(index=i, key_range=r) for i, r in enumerate(self.shards)],
            state=self.state,
            end_offsets=self.end_offsets,
            mirror_of=self.mirror_of,
        )


@dataclass
class ClientRow:
    virtual_cluster: str
    client_id: str
    kind: str
    host: str
    topics: list[str]
    acked: dict[str, int]
    ttl_s: float
    registered_ms: int
    heartbeat_ms: int
    expires_ms: int
    version: int
    owner: str = ""
    """The name of the token that registered the client ("" before revision 0006: anyone's)."""


@dataclass
class TokenRow:
    token_hash: str
    name: str
    role: str
    scope: str
    created_ms: int


@dataclass
class SettleRow:
    """An owed settle: epoch ``epoch`` was sealed by ``version`` with its end offsets unknown."""

    virtual_cluster: str
    topic: str
    epoch: int
    version: int
    created_ms: int


@dataclass
class PendingIntents:
    creating_topics: list[TopicRow] = field(default_factory=list)
    deleting_topics: list[TopicRow] = field(default_factory=list)
    creating_epochs: list[EpochRow] = field(default_factory=list)


def _topic_row(row: Any) -> TopicRow:
    return TopicRow(
        virtual_cluster=row.virtual_cluster,
        name=row.name,
        config=json.loads(row.config),
        sealed=bool(row.sealed),
        state=row.state,
        version=int(row.version),
        updated_ms=int(row.updated_ms),
    )


def _epoch_row(row: Any) -> EpochRow:
    return EpochRow(
        virtual_cluster=row.virtual_cluster,
        topic=row.topic,
        number=int(row.number),
        cluster=row.cluster,
        physical_topic=row.physical_topic,
        shards=[KeyRange.from_json(bounds) for bounds in json.loads(row.shards)],
        state=EpochState(row.state),
        end_offsets=(
            {int(k): int(v) for k, v in json.loads(row.end_offsets).items()}
            if row.end_offsets is not None
            else None
        ),
        mirror_of=row.mirror_of,
        intent=row.intent,
        updated_ms=int(row.updated_ms),
    )


def _client_row(row: Any) -> ClientRow:
    return ClientRow(
        virtual_cluster=row.virtual_cluster,
        client_id=row.client_id,
        kind=row.kind,
        host=row.host,
        topics=json.loads(row.topics),
        acked=json.loads(row.acked),
        ttl_s=float(row.ttl_s),
        registered_ms=int(row.registered_ms),
        heartbeat_ms=int(row.heartbeat_ms),
        expires_ms=int(row.expires_ms),
        version=int(row.version),
        owner=row.owner,
    )


def _cluster_model(row: Any) -> tuple[PhysicalCluster, int]:
    cluster = PhysicalCluster(
        name=row.name,
        kind=ClusterKind(row.kind),
        bootstrap=row.bootstrap,
        attributes=json.loads(row.attributes),
    )
    return cluster, int(row.version)


def _epoch_values(epoch: EpochRow) -> dict[str, Any]:
    return {
        "virtual_cluster": epoch.virtual_cluster,
        "topic": epoch.topic,
        "number": epoch.number,
        "cluster": epoch.cluster,
        "physical_topic": epoch.physical_topic,
        "shards": json.dumps([r.to_json() for r in epoch.shards]),
        "state": epoch.state.value,
        "end_offsets": json.dumps(epoch.end_offsets) if epoch.end_offsets is not None else None,
        "mirror_of": epoch.mirror_of,
        "intent": epoch.intent,
        "updated_ms": now_ms(),
    }


_READ_METADATA = (
    sa.select(
        t.topics.c.virtual_cluster,
        t.topics.c.name,
        t.topics.c.state,
        t.topics.c.config,
        t.topics.c.sealed,
        t.topics.c.version,
        t.epochs.c.number,
        t.epochs.c.cluster,
        t.epochs.c.physical_topic,
        t.epochs.c.shards,
        t.epochs.c.state.label("epoch_state"),
        t.epochs.c.end_offsets,
        t.epochs.c.mirror_of,
        t.physical_clusters.c.kind,
        t.physical_clusters.c.bootstrap,
        t.physical_clusters.c.attributes,
    )
    .select_from(
        t.topics.outerjoin(
            t.epochs,
            sa.and_(
                t.epochs.c.virtual_cluster == t.topics.c.virtual_cluster,
                t.epochs.c.topic == t.topics.c.name,
                t.epochs.c.intent == sa.literal_column("'ready'"),
            ),
        ).outerjoin(t.physical_clusters, t.physical_clusters.c.name == t.epochs.c.cluster)
    )
    .where(
        sa.tuple_(t.topics.c.virtual_cluster, t.topics.c.name).in_(
            sa.bindparam("keys", expanding=True)
        )
    )
)
"""``read_metadata_many``'s one query, built once (building a select costs more than running it).

No ORDER BY: MySQL would sort through a temporary table (the rows hold TEXT
columns), which costs ten times the query; the caller sorts the few rows."""


@functools.cache
def read_metadata_mysql(count: int) -> str:
    """``_READ_METADATA`` as MySQL text with placeholders (``%s``) for ``count`` keys, for a
    driver without SQLAlchemy: the uncached read path's query (``metadata_service.
    metadata_reader``), compiled once per key count; its arguments are the keys' parts in
    order, its columns those of ``_READ_METADATA``."""
    compiled = _READ_METADATA.params(keys=[("", "")] * count).compile(
        dialect=mysql_asyncmy.dialect(), compile_kwargs={"render_postcompile": True}
    )
    return str(compiled)


MetadataBody = tuple[int, bytes]
"""A topic's version and its TopicMetadata as the JSON a client gets."""


def metadata_body(key: tuple[str, str], rows: list[Sequence[Any]]) -> MetadataBody | None:
    """One topic's client view from its rows of ``_READ_METADATA`` (by position), as the JSON
    ``TopicMetadata.model_dump_json`` writes; None: the topic is not visible.

    Built straight from the rows, without the models: validating and dumping them cost
    three quarters of an uncached read's CPU, and every uncached read answers from here.
    The parts most topics share (a shard layout: one per shard count; a cluster) are
    rendered once (``_shards_json``, ``_cluster_json``).  The stored values were validated
    when written; the tests hold this to the models' bytes.  Every reader of the metadata is
    a client: its clusters carry their public attributes only
    (``metadata_service.cluster_secrets``)."""
    if not rows or rows[0][2] != "active" or rows[0][6] is None:
        return None
    rows.sort(key=lambda row: int(row[6]))
    head = rows[0]
    version = int(head[5])
    text = _string_json
    config = ",".join(f"{text(k)}:{text(v)}" for k, v in json.loads(head[3]).items())
    epochs = ",".join(
        f'{{"number":{int(row[6])},"cluster":{text(row[7])},'
        f'"physical_topic":{text(row[8])},"shards":{_shards_json(row[9])},'
        f'"state":{text(row[10])},"end_offsets":{_end_offsets_json(row[11])},'
        f'"mirror_of":{"null" if row[12] is None else int(row[12])}}}'
        for row in rows
    )
    clusters = ",".join(
        f"{text(name)}:{cluster}"
        for name, cluster in {
            row[7]: _cluster_json(row[7], row[13], row[14], row[15]) for row in rows
        }.items()
    )
    document = (
        f'{{"topic":{{"virtual_cluster":{text(key[0])},"name":{text(key[1])},'
        f'"config":{{{config}}},"sealed":{"true" if head[4] else "false"}}},'
        f'"version":{version},"epochs":[{epochs}],"clusters":{{{clusters}}}}}'
    )
    return version, document.encode()


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""pydantic's JSON: compact, UTF-8."""

_string_json: Callable[[str], str] = json.encoder.encode_basestring
"""A string as ``_dumps`` writes it (its C function, without the encoder's per-call set-up)."""


@functools.lru_cache(maxsize=256)
def _shards_json(stored: str) -> str:
    """An epoch's ``shards`` as the model writes them, from the stored ``[[start, end], ...]``."""
    return _dumps(
        [
            {"index": index, "key_range": [str(int(start)), str(int(end))]}
            for index, (start, end) in enumerate(json.loads(stored))
        ]
    )


def _end_offsets_json(stored: str | None) -> str:
    if stored is None:
        return "null"
    return _dumps({str(int(shard)): int(offset) for shard, offset in json.loads(stored).items()})


@functools.lru_cache(maxsize=256)
def _cluster_json(name: str, kind: str, bootstrap: str, attributes: str) -> str:
    """A cluster as a client sees it (public attributes only), as the model writes it."""
    return _dumps(
        {
            "name": name,
            "kind": kind,
            "bootstrap": bootstrap,
            "attributes": public_attributes(json.loads(attributes)),
        }
    )


def _require_owner(row: Any, owner: str, now: int) -> None:
    """``Forbidden`` unless ``owner`` registered the client, it has no owner (a row from before
    revision 0006) or it expired before ``now`` (0: never treat it as expired)."""
    if row.owner in ("", owner) or (now and row.expires_ms <= now):
        return
    raise Forbidden(
        f"client {row.client_id!r} of {row.virtual_cluster!r} was registered by another token; "
        "only that token may heartbeat, re-register or unregister it (pick another client id)"
    )


class MetadataStore:
    """Rows of the virtual layer.  Thread-safe: each call takes its own connection."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()

    def open_pool(self, connections: int) -> int:
        """Open up to ``connections`` of the pool now (``open_pool``); the count opened."""
        return open_pool(self.engine, connections)

    # ---- physical clusters -------------------------------------------------------------

    def insert_cluster(self, cluster: PhysicalCluster) -> int:
        try:
            with self._tx() as c:
                c.execute(
                    t.physical_clusters.insert().values(
                        name=cluster.name,
                        kind=cluster.kind.value,
                        bootstrap=cluster.bootstrap,
                        attributes=json.dumps(cluster.attributes),
                        version=1,
                        updated_ms=now_ms(),
                    )
                )
        except IntegrityError:
            raise Conflict(
                f"physical cluster {cluster.name!r} is already registered; delete it first or pick another name"
            ) from None
        return 1

    def get_cluster(self, name: str) -> tuple[PhysicalCluster, int]:
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(t.physical_clusters).where(t.physical_clusters.c.name == name)
            ).first()
        if row is None:
            raise ClusterNotFound(f"physical cluster {name!r} is not registered")
        return _cluster_model(row)

    def list_clusters(self) -> list[tuple[PhysicalCluster, int]]:
        with self.engine.connect() as c:
            rows = c.execute(
                sa.select(t.physical_clusters).order_by(t.physical_clusters.c.name)
            ).all()
        return [_cluster_model(row) for row in rows]

    def delete_cluster(self, name: str, expected_version: int | None) -> None:
        """Refused while an epoch lives on the cluster (a scatter read; admin-only and rare)."""
        with self._tx() as c:
            in_use = c.execute(
                sa.select(t.epochs.c.virtual_cluster, t.epochs.c.topic)
                .where(t.epochs.c.cluster == name)
                .limit(1)
            ).first()
            if in_use is not None:
                raise Conflict(
                    f"physical cluster {name!r} holds epochs of topic "
                    f"{in_use.virtual_cluster}/{in_use.topic}; delete or migrate those topics first"
                )
            query = t.physical_clusters.delete().where(t.physical_clusters.c.name == name)
            if expected_version is not None:
                query = query.where(t.physical_clusters.c.version == expected_version)
            if c.execute(query).rowcount == 0:
                exists = c.execute(
                    sa.select(t.physical_clusters.c.version).where(
                        t.physical_clusters.c.name == name
                    )
                ).first()
                if exists is None:
                    raise ClusterNotFound(f"physical cluster {name!r} is not registered")
                raise VersionConflict(
                    f"physical cluster {name!r} is at version {exists.version}, not {expected_version}"
                )

    # ---- virtual clusters --------------------------------------------------------------

    def insert_vcluster(self, vcluster: VirtualCluster) -> int:
        try:
            with self._tx() as c:
                c.execute(
                    t.virtual_clusters.insert().values(
                        name=vcluster.name,
                        description=vcluster.description,
                        version=1,
                        updated_ms=now_ms(),
                    )
                )
        except IntegrityError:
            raise Conflict(f"virtual cluster {vcluster.name!r} already exists") from None
        return 1

    def get_vcluster(self, name: str) -> tuple[VirtualCluster, int]:
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(t.virtual_clusters).where(t.virtual_clusters.c.name == name)
            ).first()
        if row is None:
            raise NotFound(f"virtual cluster {name!r} does not exist; create it first")
        return VirtualCluster(name=row.name, description=row.description), int(row.version)

    def list_vclusters(self) -> list[tuple[VirtualCluster, int]]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(t.virtual_clusters).order_by(t.virtual_clusters.c.name))
            return [
                (VirtualCluster(name=r.name, description=r.description), int(r.version))
                for r in rows
            ]

    def delete_vcluster(self, name: str) -> None:
        """Delete a virtual cluster without topics or tokens scoped to it."""
        with self._tx() as c:
            # Lock the row first: a token being scoped to it concurrently is then seen below.
            c.execute(
                sa.select(t.virtual_clusters.c.name)
                .where(t.virtual_clusters.c.name == name)
                .with_for_update()
            ).first()
            has_topic = c.execute(
                sa.select(t.topics.c.name).where(t.topics.c.virtual_cluster == name).limit(1)
            ).first()
            if has_topic is not None:
                raise Conflict(
                    f"virtual cluster {name!r} still has topics (e.g. {has_topic.name!r}); delete them first"
                )
            scoped = c.execute(
                sa.select(t.api_tokens.c.name).where(t.api_tokens.c.scope == name).limit(1)
            ).first()
            if scoped is not None:
                raise Conflict(
                    f"virtual cluster {name!r} still has tokens scoped to it "
                    f"(e.g. {scoped.name!r}); delete them first"
                )
            if (
                c.execute(
                    t.virtual_clusters.delete().where(t.virtual_clusters.c.name == name)
                ).rowcount
                == 0
            ):
                raise NotFound(f"virtual cluster {name!r} does not exist")

    # ---- topics and epochs ---------------------------------------------------------------

    def insert_topic_intent(
        self, vc: str, name: str, config: dict[str, str], epoch0: EpochRow
    ) -> None:
        """Write the 'creating' topic and its epoch 0 (intent creating) in one transaction."""
        assert epoch0.number == 0 and epoch0.intent == "creating"
        try:
            with self._tx() as c:
                c.execute(
                    t.topics.insert().values(
                        virtual_cluster=vc,
                        name=name,
                        config=json.dumps(config),
                        sealed=False,
                        state="creating",
                        version=0,
                        updated_ms=now_ms(),
                    )
                )
                c.execute(t.epochs.insert().values(**_epoch_values(epoch0)))
        except IntegrityError:
            raise TopicAlreadyExists(
                f"topic {vc}/{name} already exists (or is being created or deleted)"
            ) from None

    def activate_topic(self, vc: str, name: str) -> int:
        """creating → active with version 1; its epochs become ready.  Returns the version."""
        with self._tx() as c:
            updated = c.execute(
                t.topics.update()
                .where(
                    t.topics.c.virtual_cluster == vc,
                    t.topics.c.name == name,
                    t.topics.c.state == "creating",
                )
                .values(state="active", version=1, updated_ms=now_ms())
            ).rowcount
            if updated == 0:
                raise Conflict(f"topic {vc}/{name} is no longer being created (reconciled?)")
            c.execute(
                t.epochs.update()
                .where(t.epochs.c.virtual_cluster == vc, t.epochs.c.topic == name)
                .values(intent="ready")
            )
        return 1

    def remove_topic(self, vc: str, name: str, state: str | None = None) -> bool:
        """Delete a topic's rows (only in ``state`` when given).  False when nothing matched."""
        with self._tx() as c:
            query = t.topics.delete().where(
                t.topics.c.virtual_cluster == vc, t.topics.c.name == name
            )
            if state is not None:
                query = query.where(t.topics.c.state == state)
            if c.execute(query).rowcount == 0:
                return False
            c.execute(
                t.epochs.delete().where(t.epochs.c.virtual_cluster == vc, t.epochs.c.topic == name)
            )
            c.execute(
                t.settles.delete().where(
                    t.settles.c.virtual_cluster == vc, t.settles.c.topic == name
                )
            )
        return True

    def get_topic(self, vc: str, name: str) -> tuple[TopicRow, list[EpochRow]]:
        """The topic row and all its epoch rows (ready and in flight), oldest first."""
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(t.topics).where(t.topics.c.virtual_cluster == vc, t.topics.c.name == name)
            ).first()
            if row is None:
                raise TopicNotFound(f"topic {vc}/{name} does not exist")
            epoch_rows = c.execute(
                sa.select(t.epochs)
                .where(t.epochs.c.virtual_cluster == vc, t.epochs.c.topic == name)
                .order_by(t.epochs.c.number)
            ).all()
        return _topic_row(row), [_epoch_row(e) for e in epoch_rows]

    def read_metadata(self, vc: str, name: str) -> TopicMetadata:
        """The client view of one topic (see ``read_metadata_many``)."""
        metadata = self.read_metadata_many([(vc, name)])[(vc, name)]
        if metadata is None:
            raise TopicNotFound(f"topic {vc}/{name} does not exist")
        return metadata

    def read_metadata_many(
        self, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], TopicMetadata | None]:
        """The client view of each (virtual cluster, topic) (see ``read_metadata_bodies``)."""
        return {
            key: None if found is None else TopicMetadata.model_validate_json(found[1])
            for key, found in self.read_metadata_bodies(keys).items()
        }

    def read_metadata_bodies(
        self, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], MetadataBody | None]:
        """The client view of each (virtual cluster, topic) as its version and JSON: the active
        topic, its ready epochs and the clusters they live on; None for a topic that is not
        visible.

        One query, one round trip for all the keys: the topics joined to their
        ready epochs (same shard) and to the small reference table of physical
        clusters.  An active topic always has a ready epoch, so a topic row
        without one is not (yet, or any more) visible.
        """
        rows: dict[tuple[str, str], list[Any]] = {key: [] for key in keys}
        with self.engine.connect() as c:
            for row in c.execute(_READ_METADATA, {"keys": list(rows)}):
                rows[(row.virtual_cluster, row.name)].append(row)
        return {key: metadata_body(key, found) for key, found in rows.items()}

    def list_topics(self, vc: str, after: str | None, limit: int) -> list[TopicRow]:
        query = sa.select(t.topics).where(t.topics.c.virtual_cluster == vc)
        if after is not None:
            query = query.where(t.topics.c.name > after)
        with self.engine.connect() as c:
            rows = c.execute(query.order_by(t.topics.c.name).limit(limit)).all()
        return [_topic_row(r) for r in rows]

    def _cas_topic(
        self, c: Connection, vc: str, name: str, expected_version: int, **values: Any
    ) -> int:
        """Bump an active topic's version from ``expected_version``; raise on a lost race."""
        new_version = expected_version + 1
        updated = c.execute(
            t.topics.update()
            .where(
                t.topics.c.virtual_cluster == vc,
                t.topics.c.name == name,
                t.topics.c.version == expected_version,
                t.topics.c.state == "active",
            )
            .values(version=new_version, updated_ms=now_ms(), **values)
        ).rowcount
        if updated == 0:
            row = c.execute(
                sa.select(t.topics.c.version, t.topics.c.state).where(
                    t.topics.c.virtual_cluster == vc, t.topics.c.name == name
                )
            ).first()
            if row is None or row.state != "active":
                raise TopicNotFound(f"topic {vc}/{name} does not exist")
            raise VersionConflict(
                f"topic {vc}/{name} is at version {row.version}, not {expected_version}; "
                "re-read it and retry"
            )
        return new_version

    def update_topic(self, vc: str, name: str, expected_version: int, **values: Any) -> int:
        if "config" in values:
            values["config"] = json.dumps(values["config"])
        with self._tx() as c:
            return self._cas_topic(c, vc, name, expected_version, **values)

    def mark_deleting(self, vc: str, name: str, expected_version: int) -> int:
        """active → deleting (invisible to clients) with a version bump."""
        with self._tx() as c:
            return self._cas_topic(c, vc, name, expected_version, state="deleting")

    def insert_epoch_intent(self, epoch: EpochRow) -> None:
        assert epoch.intent == "creating"
        try:
            with self._tx() as c:
                c.execute(t.epochs.insert().values(**_epoch_values(epoch)))
        except IntegrityError:
            raise VersionConflict(
                f"epoch {epoch.number} of {epoch.virtual_cluster}/{epoch.topic} is being added "
                "by another request; re-read the topic and retry"
            ) from None

    def commit_epoch(
        self,
        vc: str,
        name: str,
        expected_version: int,
        number: int,
        sealed: dict[int, dict[int, int] | None],
    ) -> int:
        """One transaction: bump the topic, seal the given epochs, ready the new one.

        An epoch sealed without end offsets is owed a settle, recorded in the
        same transaction (see ``metadata_service.settle``).
        """
        with self._tx() as c:
            version = self._cas_topic(c, vc, name, expected_version)
            self._owe_settles(
                c, vc, name, version, [n for n, ends in sealed.items() if ends is None]
            )
            for sealed_number, end_offsets in sealed.items():
                c.execute(
                    t.epochs.update()
                    .where(
                        t.epochs.c.virtual_cluster == vc,
                        t.epochs.c.topic == name,
                        t.epochs.c.number == sealed_number,
                    )
                    .values(
                        state=EpochState.SEALED.value,
                        end_offsets=json.dumps(end_offsets) if end_offsets is not None else None,
                        updated_ms=now_ms(),
                    )
                )
            c.execute(
                t.epochs.update()
                .where(
                    t.epochs.c.virtual_cluster == vc,
                    t.epochs.c.topic == name,
                    t.epochs.c.number == number,
                    t.epochs.c.intent == "creating",
                )
                .values(intent="ready", updated_ms=now_ms())
            )
        return version

    def remove_epoch(self, vc: str, name: str, number: int, intent: str = "creating") -> bool:
        with self._tx() as c:
            return (
                c.execute(
                    t.epochs.delete().where(
                        t.epochs.c.virtual_cluster == vc,
                        t.epochs.c.topic == name,
                        t.epochs.c.number == number,
                        t.epochs.c.intent == intent,
                    )
                ).rowcount
                > 0
            )

    def update_epochs(
        self,
        vc: str,
        name: str,
        expected_version: int,
        changes: dict[int, tuple[EpochState, dict[int, int] | None]],
        topic_values: dict[str, Any] | None = None,
    ) -> int:
        """One transaction: bump the topic and set the state (and end offsets) of some epochs.

        An epoch sealed without end offsets is owed a settle, recorded in the same transaction.
        """
        values = dict(topic_values or {})
        with self._tx() as c:
            version = self._cas_topic(c, vc, name, expected_version, **values)
            owed = [
                number
                for number, (state, end_offsets) in changes.items()
                if state == EpochState.SEALED and end_offsets is None
            ]
            self._owe_settles(c, vc, name, version, owed)
            for number, (state, end_offsets) in changes.items():
                c.execute(
                    t.epochs.update()
                    .where(
                        t.epochs.c.virtual_cluster == vc,
                        t.epochs.c.topic == name,
                        t.epochs.c.number == number,
                    )
                    .values(
                        state=state.value,
                        end_offsets=json.dumps(end_offsets) if end_offsets is not None else None,
                        updated_ms=now_ms(),
                    )
                )
        return version

    # ---- owed settles ------------------------------------------------------------------

    @staticmethod
    def _owe_settles(
        c: Connection, vc: str, name: str, version: int, numbers: Sequence[int]
    ) -> None:
        created = now_ms()
        for number in numbers:
            c.execute(
                t.settles.insert().values(
                    virtual_cluster=vc,
                    topic=name,
                    epoch=number,
                    version=version,
                    created_ms=created,
                )
            )

    def owed_settles(self, vc: str | None = None, name: str | None = None) -> list[SettleRow]:
        """Owed settles of one topic, or of every topic (a scatter read, at start and in reconcile)."""
        query = sa.select(t.settles)
        if vc is not None and name is not None:
            query = query.where(t.settles.c.virtual_cluster == vc, t.settles.c.topic == name)
        order = (t.settles.c.virtual_cluster, t.settles.c.topic, t.settles.c.epoch)
        with self.engine.connect() as c:
            rows = c.execute(query.order_by(*order)).all()
        return [
            SettleRow(
                virtual_cluster=r.virtual_cluster,
                topic=r.topic,
                epoch=int(r.epoch),
                version=int(r.version),
                created_ms=int(r.created_ms),
            )
            for r in rows
        ]

    def finish_settle(
        self, vc: str, name: str, end_offsets: dict[int, dict[int, int]]
    ) -> int | None:
        """One transaction: record the end offsets of owed epochs, drop their settles, bump the topic.

        Idempotent across racing settlers (two instances, a request and a
        resume): the topic row is locked first, and only epochs whose settle
        is still owed are written, so the first settler's offsets stand.
        Returns the new version, or None when nothing was owed any more (or
        the topic is no longer active).
        """
        with self._tx() as c:
            topic = c.execute(
                sa.select(t.topics.c.version, t.topics.c.state)
                .where(t.topics.c.virtual_cluster == vc, t.topics.c.name == name)
                .with_for_update()
            ).first()
            if topic is None:
                return None
            owed = [
                number
                for number in end_offsets
                if c.execute(
                    t.settles.delete().where(
                        t.settles.c.virtual_cluster == vc,
                        t.settles.c.topic == name,
                        t.settles.c.epoch == number,
                    )
                ).rowcount
            ]
            if not owed or topic.state != "active":
                return None
            version = self._cas_topic(c, vc, name, int(topic.version))
            for number in owed:
                c.execute(
                    t.epochs.update()
                    .where(
                        t.epochs.c.virtual_cluster == vc,
                        t.epochs.c.topic == name,
                        t.epochs.c.number == number,
                    )
                    .values(end_offsets=json.dumps(end_offsets[number]), updated_ms=now_ms())
                )
        return version

    def pending_intents(self, older_than_ms: int) -> PendingIntents:
        """Topics and epochs left mid-operation before ``older_than_ms`` (a scatter read)."""
        pending = PendingIntents()
        with self.engine.connect() as c:
            for row in c.execute(
                sa.select(t.topics).where(
                    t.topics.c.state.in_(["creating", "deleting"]),
                    t.topics.c.updated_ms < older_than_ms,
                )
            ):
                topic = _topic_row(row)
                (
                    pending.creating_topics
                    if topic.state == "creating"
                    else pending.deleting_topics
                ).append(topic)
            for row in c.execute(
                sa.select(t.epochs).where(
                    t.epochs.c.intent == "creating", t.epochs.c.updated_ms < older_than_ms
                )
            ):
                epoch = _epoch_row(row)
                if epoch.number > 0:
                    pending.creating_epochs.append(epoch)
        return pending

    def all_epochs(self) -> list[EpochRow]:
        with self.engine.connect() as c:
            return [_epoch_row(r) for r in c.execute(sa.select(t.epochs))]

    def count_topics(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(sa.select(sa.func.count()).select_from(t.topics)).scalar_one())

    # ---- clients registry --------------------------------------------------------------

    def upsert_client(
        self,
        vc: str,
        client_id: str,
        kind: str,
        host: str,
        topics: Sequence[str],
        ttl_s: float,
        clients_max: int,
        owner: str,
    ) -> ClientRow:
        """Register or re-register a client for ``owner`` (a token's name).

        A live client registered by another token is ``Forbidden``; an expired
        one (not purged yet) is taken over, its acknowledgements dropped.
        Acknowledged versions of kept topics survive a re-registration by the
        same owner.
        """
        now = now_ms()
        values = {
            "owner": owner,
            "kind": kind,
            "host": host,
            "topics": json.dumps(list(topics)),
            "ttl_s": ttl_s,
            "heartbeat_ms": now,
            "expires_ms": now + int(ttl_s * 1000),
        }
        for _attempt in range(3):
            with self._tx() as c:
                row = c.execute(
                    sa.select(t.clients).where(
                        t.clients.c.virtual_cluster == vc, t.clients.c.client_id == client_id
                    )
                ).first()
                if row is not None:
                    _require_owner(row, owner, now)
                    acked = {k: v for k, v in json.loads(row.acked).items() if k in set(topics)}
                    if row.owner != owner:
                        acked = {}  # another principal's acknowledgements are not ours
                    c.execute(
                        t.clients.update()
                        .where(
                            t.clients.c.virtual_cluster == vc,
                            t.clients.c.client_id == client_id,
                        )
                        .values(acked=json.dumps(acked), version=row.version + 1, **values)
                    )
                    break
                count = c.execute(
                    sa.select(sa.func.count())
                    .select_from(t.clients)
                    .where(t.clients.c.virtual_cluster == vc)
                ).scalar_one()
                if count >= clients_max:
                    raise Backpressure(
                        f"virtual cluster {vc!r} has {count} registered clients, the maximum; "
                        "wait for idle clients to expire"
                    )
                try:
                    c.execute(
                        t.clients.insert().values(
                            virtual_cluster=vc,
                            client_id=client_id,
                            acked="{}",
                            registered_ms=now,
                            version=1,
                            **values,
                        )
                    )
                    break
                except IntegrityError:
                    continue  # a concurrent registration won: update it on the next attempt
        return self.get_client(vc, client_id, now)

    def get_client(self, vc: str, client_id: str, now: int | None = None) -> ClientRow:
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(t.clients).where(
                    t.clients.c.virtual_cluster == vc,
                    t.clients.c.client_id == client_id,
                    t.clients.c.expires_ms > (now if now is not None else now_ms()),
                )
            ).first()
        if row is None:
            raise NotFound(
                f"client {client_id!r} is not registered in {vc!r} (or expired); register it again"
            )
        return _client_row(row)

    def heartbeat_client(
        self, vc: str, client_id: str, versions: dict[str, int], owner: str
    ) -> ClientRow:
        """Extend the lease and record acknowledged versions (they only move forward).

        Only ``owner``, the token that registered the client, may (``Forbidden``);
        the compare-and-set on the row's version keeps a concurrent takeover out."""
        now = now_ms()
        for _attempt in range(5):
            current = self.get_client(vc, client_id, now)
            _require_owner(current, owner, now)
            acked = dict(current.acked)
            for topic, version in versions.items():
                if version > acked.get(topic, -1):
                    acked[topic] = version
            with self._tx() as c:
                updated = c.execute(
                    t.clients.update()
                    .where(
                        t.clients.c.virtual_cluster == vc,
                        t.clients.c.client_id == client_id,
                        t.clients.c.version == current.version,
                    )
                    .values(
                        acked=json.dumps(acked),
                        heartbeat_ms=now,
                        expires_ms=now + int(current.ttl_s * 1000),
                        version=current.version + 1,
                    )
                ).rowcount
            if updated:
                current.acked = acked
                current.heartbeat_ms = now
                current.expires_ms = now + int(current.ttl_s * 1000)
                current.version += 1
                return current
        raise VersionConflict(f"client {client_id!r} is heartbeating concurrently; retry")

    def delete_client(self, vc: str, client_id: str, owner: str | None) -> None:
        """Unregister a client: by its ``owner``, or by anyone when ``owner`` is None (an admin)."""
        with self._tx() as c:
            row = c.execute(
                sa.select(t.clients)
                .where(t.clients.c.virtual_cluster == vc, t.clients.c.client_id == client_id)
                .with_for_update()
            ).first()
            if row is None:
                raise NotFound(f"client {client_id!r} is not registered in {vc!r}")
            if owner is not None:
                _require_owner(row, owner, 0)
            c.execute(
                t.clients.delete().where(
                    t.clients.c.virtual_cluster == vc, t.clients.c.client_id == client_id
                )
            )

    def list_clients(self, vc: str, limit: int) -> list[ClientRow]:
        with self.engine.connect() as c:
            rows = c.execute(
                sa.select(t.clients)
                .where(t.clients.c.virtual_cluster == vc, t.clients.c.expires_ms > now_ms())
                .order_by(t.clients.c.client_id)
                .limit(limit)
            ).all()
        return [_client_row(r) for r in rows]

    def purge_expired_clients(self, limit: int) -> int:
        """Delete up to ``limit`` expired clients; the rest go on the next pass."""
        with self._tx() as c:
            keys = c.execute(
                sa.select(t.clients.c.virtual_cluster, t.clients.c.client_id)
                .where(t.clients.c.expires_ms <= now_ms())
                .limit(limit)
            ).all()
            removed = 0
            for key in keys:
                removed += c.execute(
                    t.clients.delete().where(
                        t.clients.c.virtual_cluster == key.virtual_cluster,
                        t.clients.c.client_id == key.client_id,
                        t.clients.c.expires_ms <= now_ms(),
                    )
                ).rowcount
        return removed

    # ---- API tokens --------------------------------------------------------------------

    def insert_token(self, token_hash: str, name: str, role: str, scope: str) -> TokenRow:
        """Store a token; its scope is ``*`` or an existing virtual cluster (exact name)."""
        row = TokenRow(token_hash, name, role, scope, now_ms())
        try:
            with self._tx() as c:
                if (
                    scope != "*"
                    and c.execute(
                        sa.select(t.virtual_clusters.c.name)
                        .where(t.virtual_clusters.c.name == scope)
                        .with_for_update()  # a concurrent delete of the vc waits, then sees us
                    ).first()
                    is None
                ):
                    raise NotFound(
                        f"virtual cluster {scope!r} does not exist (names are case-sensitive); "
                        "a token can only be scoped to an existing one, or to *"
                    )
                c.execute(
                    t.api_tokens.insert().values(
                        token_hash=token_hash,
                        name=name,
                        role=role,
                        scope=scope,
                        created_ms=row.created_ms,
                    )
                )
        except IntegrityError:
            raise Conflict(f"a token named {name!r} already exists; delete it first") from None
        return row

    def find_token(self, token_hash: str) -> TokenRow | None:
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(t.api_tokens).where(t.api_tokens.c.token_hash == token_hash)
            ).first()
        return TokenRow(**row._mapping) if row is not None else None

    def list_tokens(self) -> list[TokenRow]:
        with self.engine.connect() as c:
            return [
                TokenRow(**r._mapping)
                for r in c.execute(sa.select(t.api_tokens).order_by(t.api_tokens.c.name))
            ]

    def delete_token(self, name: str) -> None:
        with self._tx() as c:
            if c.execute(t.api_tokens.delete().where(t.api_tokens.c.name == name)).rowcount == 0:
                raise NotFound(f"no token named {name!r}")

    def count_admin_tokens(self) -> int:
        with self.engine.connect() as c:
            return int(
                c.execute(
                    sa.select(sa.func.count())
                    .select_from(t.api_tokens)
                    .where(t.api_tokens.c.role == "admin")
                ).scalar_one()
            )

    # ---- migrations (migration.machine owns the body) ---------------------------------

    def get_migration(self, vc: str, name: str) -> tuple[str, int] | None:
        """The topic's migration body (JSON) and its row version, or None."""
        m = t.migrations
        with self.engine.connect() as c:
            row = c.execute(
                sa.select(m.c.body, m.c.version).where(m.c.virtual_cluster == vc, m.c.topic == name)
            ).first()
        return None if row is None else (row.body, row.version)

    def list_migrations(self) -> list[tuple[str, str, str]]:
        """(virtual cluster, topic, body JSON) of every topic's current or last migration."""
        m = t.migrations
        with self.engine.connect() as c:
            rows = c.execute(sa.select(m.c.virtual_cluster, m.c.topic, m.c.body)).all()
        return [(r.virtual_cluster, r.topic, r.body) for r in rows]

    def put_migration(self, vc: str, name: str, body: str, expected_version: int | None) -> int:
        """Insert (``expected_version`` None) or compare-and-set the migration row; its new version."""
        m = t.migrations
        with self._tx() as c:
            if expected_version is None:
                try:
                    c.execute(
                        m.insert().values(
                            virtual_cluster=vc,
                            topic=name,
                            body=body,
                            version=1,
                            updated_ms=now_ms(),
                        )
                    )
                except IntegrityError:
                    raise VersionConflict(f"a migration of {vc}/{name} was just planned") from None
                return 1
            updated = c.execute(
                m.update()
                .where(
                    m.c.virtual_cluster == vc,
                    m.c.topic == name,
                    m.c.version == expected_version,
                )
                .values(body=body, version=expected_version + 1, updated_ms=now_ms())
            ).rowcount
        if updated == 0:
            raise VersionConflict(f"the migration of {vc}/{name} changed meanwhile; retry")
        return expected_version + 1

    def drop_epoch(self, vc: str, name: str, expected_version: int, number: int) -> int:
        """One transaction: bump the topic and delete an epoch's row (a rolled-back migration's)."""
        with self._tx() as c:
            version = self._cas_topic(c, vc, name, expected_version)
            c.execute(
                t.epochs.delete().where(
                    t.epochs.c.virtual_cluster == vc,
                    t.epochs.c.topic == name,
                    t.epochs.c.number == number,
                )
            )
        return version


def open_pool(engine: Engine, connections: int) -> int:
    """Open up to ``connections`` pooled connections now, and return them to the pool: the
    count opened.  A new PyMySQL connection builds a TLS context (~27 ms holding the GIL),
    so a pool that grew under load stalled every request of the instance once per new
    connection.  A database that does not answer yet is not an error here (the lifespan
    and ``/ready`` report it): fewer are opened, and the rest open on demand."""
    opened: list[Connection] = []
    try:
        for _ in range(connections):
            opened.append(engine.connect())
    except sa.exc.SQLAlchemyError:
        pass
    finally:
        for connection in opened:
            connection.close()
    return len(opened)
