"""The shared vocabulary of Xinfra: keyspace, model, backend contract, settings, errors, CLI.

Depends on no other package of the project; every other package depends on it.
"""

__version__ = "0.1.0"
