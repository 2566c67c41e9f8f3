"""Screenshots of the documentation site (issue 41): its home page and one reference page, built from this checkout and
opened in headless Chromium (Debian's `chromium`, driven by Playwright), into benchmarks/screenshots/.

    pip install -e ".[docs,test]" && python -m benchmarks.tools.docs_screenshots
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "benchmarks" / "screenshots"
PAGES = {"docs_home.png": "", "docs_reference_config.png": "reference/config/"}


@contextlib.contextmanager
def served(site: Path):
    """The built site on 127.0.0.1 and a free port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


def main() -> None:
    from playwright.sync_api import sync_playwright

    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    if chromium is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=REPO, check=True
        )
        with served(site) as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for name, path in PAGES.items():
                page.goto(url + path)
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(SHOTS / name))
                print(f"{SHOTS / name}: {url + path}")
            browser.close()


if __name__ == "__main__":
    main()
