"""Run an `OutboxConsumer` in the background of any asyncio application.

    async with run_consumer(pool, handlers, concurrency=16) as consumer:
        ...  # serve requests; the consumer runs in a task of its own

Entering returns once the consumer is ready (schema checked, LISTEN connection up), so a
missing migration or an unreachable database fails the application's startup instead of
dying silently in a task. Leaving stops it gracefully and waits: no new claims, running
handlers get ``shutdown_grace`` seconds to finish and are then cancelled and their events
released, outcomes are flushed, and no row is left ``processing``. A consumer that fails
while the application runs is logged at once (``aiooutbox.integrations.background``) and
its exception is raised again on exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from ..consumer import OutboxConsumer
from ..handlers import resolve_handlers

__all__ = ["run_consumer"]

logger = logging.getLogger("aiooutbox.integrations.background")


@asynccontextmanager
async def run_consumer(
    pool: asyncpg.Pool, handlers: Mapping[str, Any], **consumer_options: Any
) -> AsyncIterator[OutboxConsumer]:
    """Run ``OutboxConsumer(pool, **consumer_options).run(handlers)`` while the block runs.

    Raises on entry what would stop the consumer from working: bad handlers or options
    (`TypeError`, `InvalidArgument`), `SchemaNotReady`/`SchemaTooNew`, or the connection
    error of the LISTEN connection. The pool must outlive the block: enter this inside the
    block that creates the pool, and leave room in it for the consumer's own statements
    (a few connections; LISTEN uses a separate one).

    Cancelling the block's task during shutdown is absorbed until the consumer has
    stopped (a second cancellation cancels running handlers at once), then re-raised.
    """
    resolved = resolve_handlers(handlers)  # misuse fails here, before any task exists
    consumer = OutboxConsumer(pool, **consumer_options)
    async with consumer:  # checks the schema
        task = asyncio.create_task(
            consumer.run(resolved), name=f"aiooutbox consumer {consumer.worker_id}"
        )
        try:
            await _until_started(consumer, task)
        except BaseException:
            await _stop(consumer, task)
            raise
        closing = False

        def report(done: asyncio.Task[None]) -> None:
            if closing or done.cancelled():
                return
            error = done.exception()
            if error is None:
                logger.warning(
                    "outbox consumer %s stopped before the application did",
                    consumer.worker_id,
                    extra={"worker_id": consumer.worker_id},
                )
            else:
                logger.error(
                    "outbox consumer %s failed; events wait in the table until a consumer "
                    "runs again (the error is raised again at shutdown)",
                    consumer.worker_id,
                    exc_info=error,
                    extra={"worker_id": consumer.worker_id},
                )

        task.add_done_callback(report)
        logger.debug("outbox consumer %s is running", consumer.worker_id)
        try:
            yield consumer
        except BaseException:
            closing, reported = True, task.done()  # a task already done was reported
            await _stop(consumer, task)
            error = None if task.cancelled() else task.exception()
            if error is not None and not reported:
                logger.error(
                    "outbox consumer %s failed while the application stopped on an error",
                    consumer.worker_id,
                    exc_info=error,
                    extra={"worker_id": consumer.worker_id},
                )
            raise
        closing = True
        await _stop(consumer, task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


async def _until_started(consumer: OutboxConsumer, task: asyncio.Task[None]) -> None:
    """Return once the consumer is ready; raise what ended its task if that came first.

    The consumer runs in a task of its own rather than under ``task_group.start``: a
    consumer that fails while the application serves is logged, and must not cancel
    the application's task.
    """
    try:
        await consumer.wait_started()
    except RuntimeError:
        await asyncio.wait({task})
        if task.cancelled():
            raise RuntimeError("the outbox consumer task was cancelled during startup") from None
        error = task.exception()
        if error is not None:
            raise error from None
        raise RuntimeError(
            "the outbox consumer stopped during startup (consumer.stop() was called)"
        ) from None


async def _stop(consumer: OutboxConsumer, task: asyncio.Task[None]) -> None:
    """Stop the consumer and wait for its task, whatever happens to ours meanwhile."""
    if task.done():
        return
    consumer.stop()
    cancelled = False
    while not task.done():
        try:
            # shield(): a cancellation of this task must not cancel the consumer's
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                break  # the consumer's task itself was cancelled
            cancelled = True
            if not task.done():
                consumer.stop()  # a second request cancels running handlers now
        except BaseException:
            break  # the consumer's own error: our caller reads it from the task
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio never logs it as forgotten
    if cancelled:
        raise asyncio.CancelledError
