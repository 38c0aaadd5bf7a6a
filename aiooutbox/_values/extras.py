"""How to install an optional extra, for the messages that say one is missing.

aiooutbox is on no package index, so pip cannot find it by name: an extra is installed
from a clone of the repository, or with a wheel built from one, as the README's
"Installing" says.
"""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """The one-line command that installs ``extra``, from a clone or from a wheel."""
    return (
        f"pip install -e '.[{extra}]' in a clone of aiooutbox,"
        f" or pip install 'aiooutbox-….whl[{extra}]'"
    )
