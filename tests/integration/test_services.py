"""The fallbacks of xinfra.services really start servers: used on machines without shared ones."""

from __future__ import annotations

from pathlib import Path

import redis

from xinfra.services.mysql import start_mariadb
from xinfra.services.redis import redis_answers, start_redis


def test_private_mariadb_starts_serves_and_stops(tmp_path: Path) -> None:
    server = start_mariadb(tmp_path / "mariadb")
    try:
        url = server.create_database("xinfra_private")
        assert url.startswith(f"mysql+pymysql://root@127.0.0.1:{server.port}/xinfra_private")
        with server.connect("xinfra_private") as connection, connection.cursor() as cursor:
            cursor.execute("CREATE TABLE t (k INT PRIMARY KEY)")
            cursor.execute("INSERT INTO t VALUES (7)")
            cursor.execute("SELECT k FROM t")
            assert cursor.fetchall() == ((7,),)
    finally:
        server.stop()
    assert not server.answers()


def test_private_redis_starts_serves_and_stops(tmp_path: Path) -> None:
    process = start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(process.url)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        client.close()
    finally:
        process.stop()
    assert not redis_answers(process.url)
