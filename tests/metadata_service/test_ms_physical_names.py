"""Physical topic names: a virtual cluster's credential scope covers its own topics only.

A Northguard credential's scope is a name prefix (``vc_scope``); virtual
cluster and topic names may contain dots, so ``xinfra.<vc>.`` alone would let
the scope of ``pay`` cover the topics of ``pay.x``.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metadata_service.topics import PHYSICAL_TOPIC_LENGTH_MAX, physical_topic_name, vc_scope

NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")


def test_the_scope_of_a_vc_does_not_cover_a_vc_it_prefixes() -> None:
    assert physical_topic_name("pay", "t", 0).startswith(vc_scope("pay"))
    assert not physical_topic_name("pay.x", "t", 0).startswith(vc_scope("pay"))
    assert not physical_topic_name("pay", "x.t", 0).startswith(vc_scope("pay.x"))


@given(NAMES, NAMES, NAMES)
def test_a_physical_name_is_in_its_own_vc_scope_only(vc: str, other: str, topic: str) -> None:
    name = physical_topic_name(vc, topic, 7)
    assert len(name) <= PHYSICAL_TOPIC_LENGTH_MAX
    assert name.startswith(vc_scope(vc))
    if other != vc:
        assert not name.startswith(vc_scope(other))
