"""aiooutbox: a durable transactional outbox and work queue on one PostgreSQL table.

Producers call `enqueue` on the connection that writes their business data (asyncpg,
SQLAlchemy, psycopg; `aiooutbox.sync` for blocking code and Django), so the event commits
with it; an `OutboxConsumer` claims events in batches, runs async handlers and
settles each row as done, retry or dead.
"""

__version__ = "0.1.0.dev0"  # first, so modules may read it while the package loads

from . import sync
from .consumer import ConsumerStats, OutboxConsumer
from .errors import Dead, InvalidArgument, OutboxError, Retry, SchemaNotReady, SchemaTooNew
from .events import Event, NewEvent
from .handlers import BatchHandlerFunc, Handler, HandlerFunc, Router
from .migrations import check_schema, migrate, migration_sql
from .producer import enqueue, enqueue_many
from .retry import RetryPolicy

__all__ = [
    "BatchHandlerFunc",
    "ConsumerStats",
    "Dead",
    "Event",
    "Handler",
    "HandlerFunc",
    "InvalidArgument",
    "NewEvent",
    "OutboxConsumer",
    "OutboxError",
    "Retry",
    "RetryPolicy",
    "Router",
    "SchemaNotReady",
    "SchemaTooNew",
    "__version__",
    "check_schema",
    "enqueue",
    "enqueue_many",
    "migrate",
    "migration_sql",
    "sync",
]
