"""The Kafka backend of ``xinfra.backend``, on confluent-kafka."""
