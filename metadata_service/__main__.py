"""``python -m metadata_service serve|db``: the service without the ``xinfra`` CLI."""

from metadata_service.cli import main

main()
