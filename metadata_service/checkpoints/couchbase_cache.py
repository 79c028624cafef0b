"""The checkpoint cache on Couchbase, through the official ``couchbase`` SDK (the production choice).

One document per group, ``cp::<vc>::<group>``: ``{"complete": bool, "p": {"topic/epoch/shard": position}}``.
A flush writes through with one sub-document ``mutate_in`` per group (upsert
semantics, so a missing document is created partial); a fill reads the
document with its CAS and replaces it with the MySQL values under the fields
already there, marked complete: a flush that lands in between changes the
CAS and the fill gives up (the read already answered from MySQL).

The SDK is synchronous here and runs on worker threads; every call is
bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

from metadata_service.checkpoints.cache import GroupKey, field_name, parse_fields
from metadata_service.checkpoints.store import GroupCheckpoints

SPECS_MAX = 16
"""Couchbase takes at most 16 sub-document operations per ``mutate_in``."""


class CouchbaseCache:
    name = "couchbase"

    def __init__(
        self,
        connection: str,
        bucket: str,
        username: str,
        password: str,
        timeout_s: float = 2.0,
        ttl_s: int = 3600,
    ) -> None:
        from couchbase.auth import PasswordAuthenticator
        from couchbase.cluster import Cluster
        from couchbase.options import ClusterOptions

        self.timeout_s = timeout_s
        self.ttl = timedelta(seconds=ttl_s)
        self._cluster: Any = Cluster(
            connection, ClusterOptions(PasswordAuthenticator(username, password))
        )
        self._cluster.wait_until_ready(timedelta(seconds=timeout_s))
        self._collection: Any = self._cluster.bucket(bucket).default_collection()

    @classmethod
    def from_url(cls, url: str) -> CouchbaseCache:
        """``couchbase://host[,host]/bucket?username=U&password=P``."""
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        bucket = parts.path.strip("/") or "xinfra"
        return cls(
            f"{parts.scheme}://{parts.netloc}",
            bucket,
            query.get("username", "Administrator"),
            query.get("password", "password"),
        )

    @staticmethod
    def _id(key: GroupKey) -> str:
        return f"cp::{key[0]}::{key[1]}"

    def _get(self, key: GroupKey) -> GroupCheckpoints | None:
        from couchbase.exceptions import DocumentNotFoundException

        try:
            doc = self._collection.get(self._id(key)).content_as[dict]
        except DocumentNotFoundException:
            return None
        return parse_fields(doc.get("p", {})) if doc.get("complete") else None

    async def get_group(self, key: GroupKey) -> GroupCheckpoints | None:
        return await asyncio.to_thread(self._get, key)

    def _fill(self, key: GroupKey, values: GroupCheckpoints) -> None:
        from couchbase.exceptions import (
            CasMismatchException,
            DocumentExistsException,
            DocumentNotFoundException,
        )
        from couchbase.options import InsertOptions, ReplaceOptions

        fields = {field_name(t, e, s): p for (t, e, s), p in values.items()}
        try:
            result = self._collection.get(self._id(key))
        except DocumentNotFoundException:
            # A flush may create it meanwhile: then the next read fills it.
            with contextlib.suppress(DocumentExistsException):
                self._collection.insert(
                    self._id(key), {"complete": True, "p": fields}, InsertOptions(expiry=self.ttl)
                )
            return
        doc = result.content_as[dict]
        merged = {**fields, **doc.get("p", {})}
        # A flush or a drop coming in between leaves the entry incomplete.
        with contextlib.suppress(CasMismatchException, DocumentNotFoundException):
            self._collection.replace(
                self._id(key),
                {"complete": True, "p": merged},
                ReplaceOptions(cas=result.cas, expiry=self.ttl),
            )

    async def fill_group(self, key: GroupKey, values: GroupCheckpoints) -> None:
        await asyncio.to_thread(self._fill, key, values)

    def _put(self, values: Mapping[GroupKey, GroupCheckpoints]) -> None:
        import couchbase.subdocument as sd
        from couchbase.options import MutateInOptions

        for key, positions in values.items():
            specs = [
                sd.upsert(f"p.`{field_name(t, e, s)}`", p, create_parents=True)
                for (t, e, s), p in positions.items()
            ]
            for start in range(0, len(specs), SPECS_MAX):
                self._collection.mutate_in(
                    self._id(key),
                    specs[start : start + SPECS_MAX],
                    MutateInOptions(store_semantics=sd.StoreSemantics.UPSERT, expiry=self.ttl),
                )

    async def put(self, values: Mapping[GroupKey, GroupCheckpoints]) -> None:
        await asyncio.to_thread(self._put, values)

    def _drop(self, key: GroupKey) -> None:
        from couchbase.exceptions import DocumentNotFoundException

        with contextlib.suppress(DocumentNotFoundException):
            self._collection.remove(self._id(key))

    async def drop_group(self, key: GroupKey) -> None:
        await asyncio.to_thread(self._drop, key)

    async def close(self) -> None:
        await asyncio.to_thread(self._cluster.close)
