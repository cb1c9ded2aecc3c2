"""What the browser tests share: the OS's Chromium, a page on a viewer server, and screenshots.

Screenshots go into `docs/img/viewer_*.png` (the README shows them) when `RELAX_SCREENSHOTS=docs` is set, else
into a temporary folder, so a test run leaves the checkout clean.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.view.server import ViewServer

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "docs" / "img" if os.environ.get("RELAX_SCREENSHOTS") == "docs" else Path(tempfile.mkdtemp("-viewer"))


def chromium() -> str:
    for name in (os.environ.get("RELAX_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    pytest.skip("no Chromium on PATH: apt-get install -y chromium (or set RELAX_CHROMIUM)")


def viewer_page(browser: Any, folder: Path) -> Iterator[Any]:
    """A page of `browser` with the viewer of `folder` served, its address in `page.base`; fails the test when
    the page raised a JavaScript error."""
    server = ViewServer(folder).start()
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.base = server.url
    yield page
    page.close()
    server.stop()
    assert not errors, f"the page raised: {errors}"


def shot(page: Any, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMAGES / f"viewer_{name}.png"), full_page=True)
