"""``python -m backends.northguard.broker``: the same command as ``xinfra northguard broker``."""

from backends.northguard.cli import broker_main

if __name__ == "__main__":
    broker_main()
