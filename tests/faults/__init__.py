"""Fault-injection helpers: a TCP proxy, a private PostgreSQL server, a consumer process."""
