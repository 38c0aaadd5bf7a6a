"""Headless Chromium (Debian's package) driven by Playwright, watching what a page does:
dialogs opened, requests sent, and each document's response headers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from playwright.async_api import Page, async_playwright

from tests.programs import program

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


@dataclass
class Watched:
    page: Page
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    documents: list[Any] = field(default_factory=list)  # responses of top-level navigations
    console_errors: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def browser_page(**context: Any) -> AsyncIterator[Watched]:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=program("chromium"), args=ARGS)
        try:
            ctx = await browser.new_context(
                **{"viewport": {"width": 1360, "height": 900}, **context}
            )
            page = await ctx.new_page()
            watched = Watched(page)

            async def on_dialog(dialog: Any) -> None:
                watched.dialogs.append(dialog.message)
                await dialog.dismiss()

            page.on("dialog", on_dialog)
            page.on("request", lambda r: watched.requests.append(r.url))
            page.on(
                "response",
                lambda r: (
                    watched.documents.append(r) if r.request.resource_type == "document" else None
                ),
            )
            page.on(
                "console",
                lambda m: watched.console_errors.append(m.text) if m.type == "error" else None,
            )
            yield watched
        finally:
            await browser.close()


async def screenshot(page: Page, name: str, tmp: Path) -> None:
    """Into docs/images when AIOOUTBOX_SCREENSHOTS=1 (how the docs' pictures are made),
    else next to the test's other files."""
    target = DOCS_IMAGES if os.environ.get("AIOOUTBOX_SCREENSHOTS") == "1" else tmp
    target.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(target / f"dashboard-{name}.png"), full_page=True)
