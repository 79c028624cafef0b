"""Physical cluster backends implementing ``xinfra.backend``."""
