"""What every scenario runs on: the run itself (`bench.Bench`), its configuration, the
consumer child processes and their protocol, the databases, the server's CPU, rounds
that alternate variants, statistics, and the markdown helpers of the report.

Nothing here imports a scenario: `benchmarks.scenarios` composes the run's `Config`
from each scenario's sizes and hands the registry to `Bench` through it.
"""
