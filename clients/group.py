"""Group membership for ``XinfraConsumer``: the member side of the service's KIP-848-style protocol.

A background task heartbeats (every ``heartbeat_interval_ms`` the service
gives, at once after a change) with what the member owns; the service answers
with what the member may consume.  The consumer applies the difference inside
``poll`` (as Kafka runs rebalance callbacks in ``poll``), so a cursor is never
changed under a running read:

- shards taken away: their positions are committed (``auto_commit``), the
  listener's ``on_revoked`` runs, the shards are unassigned, and the next
  heartbeat says so at once: a revoked shard's position is committed before
  it moves (at least once);
- shards given: read from their checkpoint (the latest epoch's), or from the
  group's ``start`` when none, then ``on_assigned``;
- fenced, unknown to the group, or cut off from the service for longer than
  the session: every shard is dropped without a commit (``on_lost``), the
  commits not yet sent fail with the same error, and the member rejoins.

A pattern subscription is matched again every ``metadata_max_age_s`` (as
Kafka's ``metadata.max.age.ms``), in the heartbeat task: a new matching topic
is sent with the next heartbeat, so the group assigns its shards; a deleted
one is left, and its shards are dropped inside ``poll`` (``on_revoked``, no
commit: there is nothing left to commit to) without ``poll`` failing.

Commits go through the consumer's ``CommitQueue`` (one at a time, in order);
this class is the sink that sends each one as this member.

Group requests go to the instance that coordinates the group: a 307 from
another instance is followed, and that instance is used until it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import httpx

from xinfra.errors import Fenced, InvalidRequest, NotFound, TopicNotFound, Unavailable, XinfraError
from xinfra.model import Position
from xinfra.rest import MetadataClient, tls_context

if TYPE_CHECKING:
    from clients.consumer import StartAt, XinfraConsumer

log = logging.getLogger(__name__)

Shard = tuple[str, int]
"""(topic, shard)."""
REDIRECTS_MAX = 3
PENDING_INTERVAL_S = 0.05
TOPICS_PAGE_MAX = 1000
TOPICS_MAX = 100_000
"""Topics a pattern is matched against at most (the virtual cluster's first ones by name)."""


class RebalanceListener(Protocol):
    """Called inside ``poll``; each receives the (topic, shard) pairs concerned."""

    async def on_revoked(self, shards: list[Shard]) -> None: ...

    async def on_assigned(self, shards: list[Shard]) -> None: ...

    async def on_lost(self, shards: list[Shard]) -> None: ...


@dataclass(frozen=True, slots=True)
class GroupOptions:
    auto_commit: bool = True
    """Commit the positions of owned shards every ``auto_commit_interval_s`` (in ``poll``),
    before a revoked shard moves, and on close."""
    auto_commit_interval_s: float = 5.0
    start: StartAt | int = "earliest"
    """Where a shard the group never committed is read from: earliest, latest or a timestamp (ms)."""
    join_timeout_s: float = 30.0
    metadata_max_age_s: float = 300.0
    """How often a pattern subscription is matched against the topics again (Kafka's
    ``metadata.max.age.ms``, 5 min by default); topics created or deleted meanwhile are
    joined or left after at most this long plus a heartbeat."""


class GroupClient:
    """HTTP to the coordinating instance of one group, following its redirects."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.coordinator: str | None = None
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout_s, verify=tls_context())

    async def call(self, method: str, path: str, json: Any = None) -> Any:
        for _ in range(REDIRECTS_MAX + 1):
            base = self.coordinator or self.url
            try:
                response = await self._http.request(method, base + path, json=json)
            except httpx.TransportError as error:
                if self.coordinator is not None:
                    self.coordinator = None  # the coordinator is gone: ask the bootstrap URL
                    continue
                raise Unavailable(
                    f"the metadata service at {base} is unreachable ({error})"
                ) from None
            if response.status_code == 307 and "location" in response.headers:
                parts = urlsplit(response.headers["location"])
                self.coordinator = f"{parts.scheme}://{parts.netloc}"
                continue
            if response.status_code >= 400:
                raise MetadataClient._error(response)
            return response.json() if response.content else None
        raise Unavailable(
            f"{path}: the coordinator of the group did not answer ({REDIRECTS_MAX} redirects); "
            "retry: a new one takes over once its ZooKeeper session ends"
        )

    async def close(self) -> None:
        await self._http.aclose()


class GroupMembership:
    """One consumer's membership of one group; the consumer's ``CommitSink``."""

    def __init__(
        self,
        consumer: XinfraConsumer,
        group: str,
        client: GroupClient,
        virtual_cluster: str,
        options: GroupOptions | None = None,
        member_id: str | None = None,
    ) -> None:
        self.consumer = consumer
        self.group = group
        self.client = client
        self.options = options or GroupOptions()
        self.member_id = member_id or f"member-{uuid.uuid4().hex[:12]}"
        self.member_epoch = 0
        self._path = f"/v1/vclusters/{virtual_cluster}/groups/{group}"
        self._vc = virtual_cluster
        self._topics: list[str] = []
        self._pattern: re.Pattern[str] | None = None
        self._rematch_at = 0.0
        self._stopping = False
        self._send_topics = False
        self._listener: RebalanceListener | None = None
        self._owned: set[Shard] = set()
        self._allowed: set[Shard] = set()
        self._changed = False
        self._lost: XinfraError | None = None
        self._wake = asyncio.Event()
        self._interval_s = 1.0
        self._session_s = 10.0
        self._last_ok = 0.0
        self._next_commit = 0.0
        self._committed: dict[Shard, Position] = {}
        self._task: asyncio.Task[None] | None = None

    # -- joining ---------------------------------------------------------------------------

    async def subscribe(
        self, topics: Sequence[str] | re.Pattern[str], listener: RebalanceListener | None = None
    ) -> None:
        """Join the group for ``topics``: names, or a pattern (matched now and every
        ``metadata_max_age_s``, so topics created later are joined too).

        Returns once joined and the first assignment is applied; raises
        ``TopicNotFound`` for an unknown topic, ``Unavailable`` after
        ``join_timeout_s`` without an answer.
        """
        loop = asyncio.get_running_loop()
        if isinstance(topics, re.Pattern):
            names = await self._matching(topics)
            self._pattern = topics
            self._rematch_at = loop.time() + self.options.metadata_max_age_s
        else:
            names, self._pattern = sorted(set(topics)), None
        if not names:
            raise InvalidRequest("subscribe to at least one topic")
        for topic in names:
            await self.consumer.metadata(topic)
        self._topics, self._listener, self._send_topics = names, listener, True
        deadline = loop.time() + self.options.join_timeout_s
        while not await self._beat():
            if self._lost is not None and not self._lost.retriable:
                raise self._lost
            if loop.time() >= deadline:
                raise Unavailable(f"could not join group {self.group!r} in time")
            await asyncio.sleep(0.1)
        self._next_commit = loop.time() + self.options.auto_commit_interval_s
        if self._task is None:
            self._task = loop.create_task(self._heartbeats(), name=f"group:{self.group}")
        await self.reconcile()

    async def _matching(self, pattern: re.Pattern[str]) -> list[str]:
        """The virtual cluster's topics that ``pattern`` matches whole, page by page."""
        names: list[str] = []
        after = ""
        while len(names) < TOPICS_MAX:
            query = f"limit={TOPICS_PAGE_MAX}" + (f"&after={after}" if after else "")
            body = await self.client.call("GET", f"/v1/vclusters/{self._vc}/topics?{query}")
            names += (t["name"] for t in body["topics"])
            after = body.get("next_after") or ""
            if not after:
                break
        return sorted(name for name in names if pattern.fullmatch(name))

    async def _rematch(self) -> None:
        """Match the pattern again; a changed topic list goes with the next heartbeat."""
        assert self._pattern is not None
        loop = asyncio.get_running_loop()
        self._rematch_at = loop.time() + self.options.metadata_max_age_s
        try:
            names = await self._matching(self._pattern)
            for topic in [t for t in names if t not in self._topics]:
                try:
                    await self.consumer.metadata(topic)  # assign needs it: fetch and watch now
                except TopicNotFound:
                    names.remove(topic)  # deleted since the listing
        except XinfraError as error:
            log.warning(
                "matching %s for group %s failed: %s", self._pattern.pattern, self.group, error
            )
            return
        if names and names != self._topics:
            log.info(
                "group %s: pattern %s now matches %s", self.group, self._pattern.pattern, names
            )
            self._topics, self._send_topics = names, True

    # -- heartbeats ------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        """Heartbeat until ``close``; owned by this membership, which cancels and awaits it.

        ``_stopping`` is checked as well as cancellation: on Python 3.11,
        ``wait_for`` swallows a cancel that arrives as the event it waits on is
        set, and ``close`` would then wait for this loop forever.
        """
        loop = asyncio.get_running_loop()
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()
            if self._stopping:
                return
            try:
                if self._pattern is not None and loop.time() >= self._rematch_at:
                    await self._rematch()
                if self._lost is None:
                    await self._beat()
            except Exception:  # a bug must not end the heartbeats silently: log it, go on
                log.exception("heartbeat of group %s failed", self.group)

    async def _beat(self) -> bool:
        """One heartbeat; True when the service answered."""
        loop = asyncio.get_running_loop()
        body: dict[str, Any] = {
            "member_id": self.member_id,
            "member_epoch": self.member_epoch,
            "owned": sorted(self._owned),
        }
        sent_topics = self.member_epoch == 0 or self._send_topics
        if sent_topics:
            body["topics"] = self._topics
        try:
            out = await self.client.call("POST", f"{self._path}/heartbeat", json=body)
        except Fenced as error:  # replaced, or removed by the group: stop, then rejoin
            self._lost = error
            return False
        except TopicNotFound as error:
            if not sent_topics or self._pattern is None:
                self._lost = error
                return False
            # A matched topic was deleted since the last match: match again, then send.
            log.info("group %s: %s; matching %s again", self.group, error, self._pattern.pattern)
            self._rematch_at = 0.0
            self._wake.set()
            return False
        except XinfraError as error:
            if not error.retriable:
                self._lost = error
                return False
            log.warning("heartbeat to group %s failed: %s", self.group, error)
            if self.member_epoch > 0 and loop.time() - self._last_ok > self._session_s:
                self._lost = error  # the group has given our shards away by now
            return False
        self._last_ok = loop.time()
        if sent_topics:
            self._send_topics = False
        self.member_epoch = int(out["member_epoch"])
        self._interval_s = out["heartbeat_interval_ms"] / 1000
        if out["pending"]:
            # Waiting for shards others are giving up: ask again soon, not a whole interval later.
            self._interval_s = min(self._interval_s, PENDING_INTERVAL_S)
        self._session_s = out["session_timeout_ms"] / 1000
        allowed = {(t, int(s)) for t, s in out["assignment"]}
        if allowed != self._allowed or allowed != self._owned:
            self._allowed, self._changed = allowed, True
        return True

    # -- applying assignments (inside poll) ------------------------------------------------

    async def reconcile(self) -> None:
        """Apply what the last heartbeat said; called by ``poll`` before it reads."""
        loop = asyncio.get_running_loop()
        if self._pattern is not None:
            await self._drop_deleted()
        silent_s = loop.time() - self._last_ok
        if self._lost is None and self.member_epoch > 0 and silent_s > self._session_s:
            # No heartbeat answered for a whole session (a pause, a partition): the group has
            # given our shards away, so stop reading them before the service even says so.
            self._lost = Unavailable(f"no heartbeat answered for {silent_s:.1f} s")
        if self._lost is not None:
            await self._drop_all()
        if self._changed:
            self._changed = False
            allowed = set(self._allowed)
            revoked = sorted(self._owned - allowed)
            added = sorted(allowed - self._owned)
            try:
                if revoked:
                    await self._revoke(revoked)
                if added:
                    await self._assign(added)
            except BaseException:
                self._changed = True  # not applied: the next poll tries again
                raise
            finally:
                if revoked or added:
                    self._wake.set()  # tell the coordinator at once
        if self.options.auto_commit and loop.time() >= self._next_commit and self._owned:
            self._next_commit = loop.time() + self.options.auto_commit_interval_s
            with contextlib.suppress(XinfraError):  # a failed auto-commit is retried next time
                await self._commit_owned(self._owned)

    async def _revoke(self, shards: list[Shard]) -> None:
        if self.options.auto_commit:
            try:
                await self._commit_owned(set(shards))
            except XinfraError as error:
                log.warning("committing revoked shards of %s failed: %s", self.group, error)
        if self._listener is not None:
            await self._listener.on_revoked(shards)
        self._unassign(shards)

    async def _drop_deleted(self) -> None:
        """Drop the shards of matched topics the service says are gone, before ``poll`` reads.

        The consumer's watch learns of a delete before the group retargets; the
        shards are revoked here (``on_revoked``, no commit: the topic is gone)
        and the pattern is matched again, so the next heartbeat leaves the topic.
        """
        gone = [t for t in self._topics if isinstance(self.consumer.topic_error(t), NotFound)]
        if not gone:
            return
        shards = sorted(s for s in self._owned if s[0] in gone)
        log.info("group %s: topics %s were deleted; dropping %s", self.group, gone, shards)
        if shards and self._listener is not None:
            await self._listener.on_revoked(shards)
        self._unassign(shards)
        for topic in gone:
            await self.consumer.forget(topic)
        self._topics = [t for t in self._topics if t not in gone]
        self._allowed = {s for s in self._allowed if s[0] not in gone}
        self._send_topics, self._rematch_at = True, 0.0
        self._wake.set()

    async def _assign(self, shards: list[Shard]) -> None:
        checkpoints = await self._checkpoints()
        by_topic: dict[str, list[int]] = {}
        for topic, shard in shards:
            by_topic.setdefault(topic, []).append(shard)
        for topic, numbers in by_topic.items():
            await self.consumer.assign(topic, numbers, start=self.options.start)
            for shard in numbers:
                rows = checkpoints.get((topic, shard), [])
                if rows:
                    position = rows[-1]
                    # The row of an earlier epoch says how far it was delivered: used when the
                    # position's epoch mirrors it (see ``XinfraConsumer.seek``).
                    delivered = rows[-2] if len(rows) > 1 else None
                    try:
                        self.consumer.seek(topic, position, delivered)
                    except InvalidRequest as error:  # its epoch is gone (retention): start over
                        log.warning("checkpoint of %s/%d not usable: %s", topic, shard, error)
                    self._committed[(topic, shard)] = position
        self._owned.update(shards)
        if self._listener is not None:
            await self._listener.on_assigned(shards)

    def _unassign(self, shards: Sequence[Shard]) -> None:
        by_topic: dict[str, list[int]] = {}
        for topic, shard in shards:
            by_topic.setdefault(topic, []).append(shard)
            self._committed.pop((topic, shard), None)
        for topic, numbers in by_topic.items():
            self.consumer.unassign(topic, numbers)
        self._owned.difference_update(shards)

    async def _drop_all(self) -> None:
        lost, self._lost = self._lost, None
        shards = sorted(self._owned)
        log.warning("group %s: lost %d shards (%s); rejoining", self.group, len(shards), lost)
        if self._listener is not None and shards:
            await self._listener.on_lost(shards)
        self._unassign(shards)
        self._allowed, self._changed = set(), False
        self.member_epoch = 0
        # Positions read under the lost assignment: never commit them after the rejoin.
        self.consumer.commits.fail_queued(
            lost if lost is not None else Unavailable(f"group {self.group!r}: shards lost")
        )
        self._wake.set()

    # -- commits ---------------------------------------------------------------------------

    async def _commit_owned(self, shards: set[Shard]) -> None:
        positions = {k: p for k, p in self.consumer.positions().items() if k in shards}
        fresh = {k: p for k, p in positions.items() if self._committed.get(k) != p}
        if fresh:
            await self.consumer.commit(fresh)  # queued behind the application's commits: in order

    async def commit(self, positions: dict[tuple[str, int], Position]) -> None:
        """Send one commit as this member (the ``CommitQueue``'s sink); durable on return.

        ``Fenced``: this member was replaced.  Applications commit through the
        consumer (``commit``, ``commit_async``), which keeps commits in order.
        """
        if self.member_epoch <= 0:
            raise InvalidRequest(f"not a member of group {self.group!r} yet: subscribe first")
        crossings = self.consumer.crossings()
        rows: list[tuple[str, Position]] = []
        for key, position in sorted(positions.items()):
            rows.append((key[0], position))
            # Beside a position in a migration target, the source's end its cursor crossed
            # from: the shard's next owner skips the mirrors that may still follow (``_assign``).
            # Not beside a position in the source or before it: the latest row is the position.
            crossing = crossings.get(key)
            if crossing is not None and crossing.epoch < position.epoch:
                rows.append((key[0], crossing))
        body = {
            "member_id": self.member_id,
            "member_epoch": self.member_epoch,
            "positions": [
                {"topic": t, "epoch": p.epoch, "shard": p.shard, "offset": p.offset}
                for t, p in rows
            ],
        }
        try:
            await self.client.call("POST", f"{self._path}/commit", json=body)
        except Fenced as error:
            self._lost = error
            raise
        self._committed.update(positions)

    async def committed(self) -> dict[Shard, Position]:
        """The group's committed position per (topic, shard): the one in its latest epoch."""
        return {shard: rows[-1] for shard, rows in (await self._checkpoints()).items()}

    async def _checkpoints(self) -> dict[Shard, list[Position]]:
        """The group's checkpoints per (topic, shard), one per epoch, in epoch order."""
        try:
            body = await self.client.call("GET", f"{self._path}/checkpoints")
        except XinfraError as error:
            if error.code == "group_not_found":
                return {}
            raise
        out: dict[Shard, list[Position]] = {}
        for p in sorted(body["positions"], key=lambda p: (p["topic"], p["shard"], p["epoch"])):
            position = Position(p["epoch"], p["shard"], p["offset"])
            out.setdefault((p["topic"], p["shard"]), []).append(position)
        return out

    def owned(self) -> list[Shard]:
        return sorted(self._owned)

    async def close(self) -> None:
        """Stop heartbeating, commit what is owned (``auto_commit``) after the queued commits,
        then leave the group, so the next owner of a shard starts where this one stopped."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.member_epoch > 0:
            if self.options.auto_commit and self._owned:
                try:
                    await self._commit_owned(self._owned)
                except XinfraError as error:
                    log.warning("committing at close of group %s failed: %s", self.group, error)
            await self.consumer.commits.flush()
            with contextlib.suppress(XinfraError):
                await self.client.call(
                    "POST",
                    f"{self._path}/heartbeat",
                    json={"member_id": self.member_id, "member_epoch": -1},
                )
            self.member_epoch = 0
        await self.client.close()
