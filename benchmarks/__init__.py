"""aiooutbox benchmarks, side by side with PgQueuer: ``python -m benchmarks --dsn ...``.

Not part of the installed package; needs the ``bench`` extra (pgqueuer, psutil,
matplotlib). See docs/benchmarks.md for the latest results and how they were made, and
benchmarks/README.md for the layout and how to add a scenario.
"""
