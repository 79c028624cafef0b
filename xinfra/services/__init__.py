"""Local services for tests and ``xinfra up``: the one place that knows how to start each.

ZooKeeper, the Kafka-protocol broker (tansu), MySQL (MariaDB) and Redis each
have a module with one ``start_*``/``ensure_*`` function.  The test fixtures
and ``xinfra up`` call these and nothing else.
"""
