"""Running aiooutbox inside applications.

- `aiooutbox.integrations.background`: ``run_consumer``, a framework-neutral async context
  manager that runs a consumer in the background of any asyncio application.
- `aiooutbox.integrations.fastapi`: a lifespan helper and request dependencies
  (the ``fastapi`` extra: ``pip install -e '.[fastapi]'`` in a clone).
- `aiooutbox.integrations.aiohttp`: a ``cleanup_ctx`` helper and typed ``AppKey`` s
  (the ``aiohttp`` extra: ``pip install -e '.[aiohttp]'`` in a clone).

Each framework is imported only by its own module, never by ``import aiooutbox``.
"""
