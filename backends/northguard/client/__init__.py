"""The Northguard client: admin requests, produce and consume streams, the shard producer and reader.

* ``AdminClient`` / ``TopicView`` (``admin.py``): unary metadata requests.
* ``ProduceStream`` / ``ConsumeStream``: the client ends of the sessionized streams.
* ``NorthguardProducer`` / ``NorthguardReader``: the ``xinfra.backend`` producer and reader.

Import them from their modules: a broker uses the connection and the streams
(replication, peers), and this package importing the producer and the reader
made every broker start import the model and the settings too.
"""
