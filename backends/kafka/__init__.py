"""The Kafka backend of Xinfra, on confluent-kafka (librdkafka).

Public surface: ``KafkaBackend`` (``backends.kafka.backend``), found through
the ``xinfra.backends`` entry point ``kafka``.  Modules: ``admin`` (topics),
``producer`` (shard producer), ``reader`` (shard reader), ``errors``
(librdkafka errors as ``xinfra.errors``), ``config`` (librdkafka settings and
their bounds).
"""
