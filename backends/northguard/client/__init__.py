"""The Northguard client: admin requests, produce and consume streams, the shard producer and reader.

* ``AdminClient`` / ``TopicView`` (``admin.py``): unary metadata requests.
* ``ProduceStream`` / ``ConsumeStream``: the client ends of the sessionized streams.
* ``NorthguardProducer`` / ``NorthguardReader``: the ``xinfra.backend`` producer and reader.
"""

from backends.northguard.client.admin import AdminClient, RangeView, TopicView
from backends.northguard.client.connection import ClientConnection
from backends.northguard.client.consume_stream import ConsumeStream
from backends.northguard.client.produce_stream import ProduceStream
from backends.northguard.client.producer import NorthguardProducer
from backends.northguard.client.reader import NorthguardReader

__all__ = [
    "AdminClient",
    "ClientConnection",
    "ConsumeStream",
    "NorthguardProducer",
    "NorthguardReader",
    "ProduceStream",
    "RangeView",
    "TopicView",
]
