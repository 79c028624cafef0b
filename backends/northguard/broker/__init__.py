"""The Northguard broker: server, sessions, coordinator, range logs, health and metrics.

Public surface: ``Broker`` and ``BrokerConfig`` (``server.py``), ``run_broker``
(``main.py``).  ``python -m backends.northguard.broker --help`` runs one.
"""

from backends.northguard.broker.server import Broker, BrokerConfig

__all__ = ["Broker", "BrokerConfig"]
