"""A handlers module whose batch handler is refused as it is made (a batch of 0), for
the CLI's bad-input tests: the error names this file's line, not the check's."""

import aiooutbox


async def bulk(events: list[aiooutbox.Event]) -> None:
    return None


handlers = {"t": aiooutbox.Handler(bulk, batch=0)}
