"""The group protocol over HTTP on one instance: join, reconcile without a barrier, fencing,
commits and their errors (each a 4xx problem+json with a stable code)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
from groups_harness import HEADERS, VC, ThreadService, create_topic, register_kafka
from kazoo.client import KazooClient

from metadata_service import ServiceConfig


def topic_name() -> str:
    return f"orders-{uuid.uuid4().hex[:8]}"


class Member:
    """A raw protocol member: what the SDK does, step by step, so each step can be checked."""

    def __init__(self, url: str, group: str, member_id: str, topics: list[str]) -> None:
        self.http = httpx.Client(base_url=url, headers=HEADERS, timeout=30)
        self.group, self.member_id, self.topics = group, member_id, topics
        self.epoch = 0
        self.owned: list[list[Any]] = []
        self.revocations = 0

    def beat(self, **overrides: Any) -> httpx.Response:
        body: dict[str, Any] = {
            "member_id": self.member_id,
            "member_epoch": self.epoch,
            "owned": self.owned,
        }
        if self.epoch == 0:
            body["topics"] = self.topics
        body.update(overrides)
        return self.http.post(f"/v1/vclusters/{VC}/groups/{self.group}/heartbeat", json=body)

    def step(self) -> dict[str, Any]:
        """One heartbeat; give up what the answer leaves out, take what it adds."""
        response = self.beat()
        assert response.status_code == 200, response.text
        out: dict[str, Any] = response.json()
        assignment = [list(u) for u in out["assignment"]]
        if any(u not in assignment for u in self.owned):
            self.revocations += 1
        self.owned, self.epoch = assignment, out["member_epoch"]
        return out

    def commit(
        self, positions: list[dict[str, int | str]], epoch: int | None = None
    ) -> httpx.Response:
        return self.http.post(
            f"/v1/vclusters/{VC}/groups/{self.group}/commit",
            json={
                "member_id": self.member_id,
                "member_epoch": self.epoch if epoch is None else epoch,
                "positions": positions,
            },
        )


def settle(members: list[Member], rounds_max: int = 20) -> None:
    """Heartbeat every member until none is pending; at every step no shard has two owners."""
    for _ in range(rounds_max):
        outs = [m.step() for m in members]
        owned = [tuple(u) for m in members for u in m.owned]
        assert len(owned) == len(set(owned)), f"a shard with two owners: {owned}"
        if not any(o["pending"] for o in outs):
            return
    raise AssertionError("the group did not settle")


def assert_problem(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["code"] == code


def test_join_rebalance_unaffected_member_never_revokes(service: ThreadService, kafka: str) -> None:
    topic = topic_name()
    create_topic(service.url, topic, shards=6)
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = Member(service.url, group, "a", [topic])
    settle([a])
    assert len(a.owned) == 6
    b = Member(service.url, group, "b", [topic])
    settle([a, b])
    assert (len(a.owned), len(b.owned)) == (3, 3)
    a_revocations = a.revocations
    # c joins: a and b each give one shard, in their own time; nobody waits for everybody.
    c = Member(service.url, group, "c", [topic])
    settle([a, b, c])
    assert sorted(len(m.owned) for m in (a, b, c)) == [2, 2, 2]
    assert a.revocations == a_revocations + 1
    # A fourth member on another topic moves nothing of the first one: nobody revokes.
    other = topic_name()
    create_topic(service.url, other, shards=2)
    before = {m.member_id: (m.revocations, list(m.owned)) for m in (a, b, c)}
    d = Member(service.url, group, "d", [other])
    settle([a, b, c, d])
    assert {m.member_id: (m.revocations, m.owned) for m in (a, b, c)} == before
    assert len(d.owned) == 2


def test_fenced_and_unknown_members_and_bad_commits(
    service: ThreadService, kafka: str, zookeeper: str, zk_root: str
) -> None:
    topic = topic_name()
    create_topic(service.url, topic, shards=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    old = Member(service.url, group, "m1", [topic])
    settle([old])
    position = {"topic": topic, "epoch": 0, "shard": 0, "offset": 0}
    assert old.commit([position]).status_code == 204
    # The same member id rejoins (a restarted process): the old incarnation is fenced.
    new = Member(service.url, group, "m1", [topic])
    settle([new])
    assert_problem(old.beat(), 409, "fenced")
    assert_problem(old.commit([position]), 409, "fenced")
    assert new.commit([position]).status_code == 204
    # A member the group never had, a commit past the end, a shard it does not own.
    assert_problem(
        Member(service.url, group, "ghost", [topic]).beat(member_epoch=3), 404, "unknown_member"
    )
    assert_problem(new.commit([{**position, "offset": 10**6}]), 416, "offset_out_of_range")
    assert_problem(new.commit([{**position, "epoch": 7}]), 400, "invalid_request")
    # Unknown group, unknown topic, malformed body.
    http = new.http
    probed = [f"nope-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    for name in probed:
        assert_problem(http.get(f"/v1/vclusters/{VC}/groups/{name}"), 404, "group_not_found")
        assert_problem(
            http.get(f"/v1/vclusters/{VC}/groups/{name}/checkpoints"), 404, "group_not_found"
        )
        assert_problem(http.delete(f"/v1/vclusters/{VC}/groups/{name}"), 404, "group_not_found")
    zk = KazooClient(hosts=zookeeper)
    zk.start(timeout=10)
    try:  # a probe leaves no claim behind: no znode, so names cannot be grown by probing
        assert zk.exists(f"{zk_root}/groups/{VC}/{group}")
        assert not [n for n in probed if zk.exists(f"{zk_root}/groups/{VC}/{n}")]
    finally:
        zk.stop()
        zk.close()
    response = http.post(
        f"/v1/vclusters/{VC}/groups/{group}/heartbeat",
        json={"member_id": "x", "member_epoch": 0, "topics": ["no-such-topic"]},
    )
    assert_problem(response, 404, "topic_not_found")
    assert_problem(
        http.post(f"/v1/vclusters/{VC}/groups/{group}/heartbeat", json={"member_epoch": "x"}),
        422,
        "invalid_request",
    )
    # Describe shows the member, its shards and what it committed.
    described = http.get(f"/v1/vclusters/{VC}/groups/{group}").json()
    assert described["state"] == "stable" and described["members"] == 1
    assert described["member_list"][0]["assignment"] == [[topic, 0], [topic, 1]]
    shard0 = next(s for s in described["shards"] if s["shard"] == 0)
    assert shard0["committed"]["offset"] == 0 and shard0["lag"] == 0


def test_without_zookeeper_one_instance_coordinates_every_group(
    make_config: Callable[..., ServiceConfig], kafka_bootstrap: str
) -> None:
    """The embedded default (no ZooKeeper): groups and checkpoints work on one instance."""
    instance = ThreadService(make_config(zookeeper=None)).start()
    try:
        register_kafka(instance.url, kafka_bootstrap)
        topic = topic_name()
        create_topic(instance.url, topic, shards=3)
        group = f"g-{uuid.uuid4().hex[:8]}"
        a, b = Member(instance.url, group, "a", [topic]), Member(instance.url, group, "b", [topic])
        settle([a, b])
        assert sorted(len(m.owned) for m in (a, b)) == [1, 2]
        shard = a.owned[0][1]
        position = {"topic": topic, "epoch": 0, "shard": shard, "offset": 0}
        assert a.commit([position]).status_code == 204
        assert_problem(b.commit([position]), 409, "fenced")  # not b's shard
        committed = a.http.get(f"/v1/vclusters/{VC}/groups/{group}/checkpoints").json()
        assert committed["positions"] == [position]
    finally:
        instance.stop()


def test_commits_the_fast_path_leaves_to_the_router(
    make_config: Callable[..., ServiceConfig], kafka_bootstrap: str
) -> None:
    """Commits are served outside FastAPI's routing; what that path does not take (a body the
    model refuses, no Content-Length, no token, a group coordinated elsewhere) gets the
    router's answer, the body replayed to it."""
    a = ThreadService(make_config()).start()
    b = ThreadService(make_config()).start()
    try:
        register_kafka(a.url, kafka_bootstrap)
        topic = topic_name()
        create_topic(a.url, topic, shards=2)
        group = f"g-{uuid.uuid4().hex[:8]}"
        path = f"/v1/vclusters/{VC}/groups/{group}/commit"
        body = {"positions": [{"topic": topic, "epoch": 0, "shard": 1, "offset": 0}]}
        with httpx.Client(base_url=a.url, headers=HEADERS, timeout=30) as http:
            assert http.post(path, json=body).status_code == 204  # a coordinates the group now
            assert_problem(http.post(path, json={"positions": []}), 422, "invalid_request")
            json_type = {"Content-Type": "application/json"}
            assert_problem(
                http.post(path, content=b"{not json", headers=json_type), 422, "invalid_request"
            )
            chunked = http.post(  # no Content-Length: the router reads it
                path,
                headers=json_type,
                content=iter(
                    [
                        b'{"positions": [{"topic": "',
                        topic.encode(),
                        b'", "epoch": 0, "shard": 0, "offset": 0}]}',
                    ]
                ),
            )
            assert chunked.status_code == 204, chunked.text
            committed = http.get(f"/v1/vclusters/{VC}/groups/{group}/checkpoints").json()
            assert sorted(p["shard"] for p in committed["positions"]) == [0, 1]
        assert_problem(httpx.post(f"{a.url}{path}", json=body, timeout=30), 401, "unauthenticated")
        redirected = httpx.post(f"{b.url}{path}", json=body, headers=HEADERS, timeout=30)
        assert redirected.status_code == 307, redirected.text
        assert redirected.headers["location"] == f"{a.url}{path}"
    finally:
        b.stop()
        a.stop()
