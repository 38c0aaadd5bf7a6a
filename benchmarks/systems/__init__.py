"""The systems under benchmark, each a parent side (``System``: its database, loading,
producers) and a child side (``consume``, run by `benchmarks.harness.child`):
aiooutbox, PgQueuer, and the references' peers (the bare asyncpg loop, awa-pg,
procrastinate); and the producer per driver path (``python -m benchmarks.systems.drivers``).
"""
