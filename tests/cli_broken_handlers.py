"""A handlers module that fails on import, for the CLI's bad-input tests."""

handlers = 1 / 0
