"""``python -m aiooutbox``: see `aiooutbox.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m aiooutbox"))
