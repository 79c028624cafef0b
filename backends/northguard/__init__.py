"""Northguard: the replicated log storage system that ships with Xinfra (DESIGN.md §3)."""
