"""Subcommands of ``xinfra`` that talk to the metadata service over HTTP (``xinfra.rest``)."""
