"""Whether a callable returns a coroutine: handlers must, decoders must not."""

from __future__ import annotations

import functools
import inspect


def is_async_callable(func: object) -> bool:
    """An async function, a `functools.partial` of one, or an instance whose class has an
    async ``__call__``. A class is not (calling it makes an instance), nor is any object
    that merely has a ``func`` attribute."""
    while isinstance(func, functools.partial):
        func = func.func
    if inspect.iscoroutinefunction(func):
        return True
    if isinstance(func, type):
        return False
    call = getattr(type(func), "__call__", None)  # noqa: B004 - async __call__ on instances
    return inspect.iscoroutinefunction(call)
