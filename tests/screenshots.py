"""`make screenshots`: the README's pictures of the web page, taken in Debian's chromium from
the real `slurm-medic web` on the seeded record of the browser tests (tests/browser.py).

    .venv/bin/python -m tests.screenshots [OUT_DIR]     # default docs/screenshots

The pages are seen as alice on a site that lets everyone see every run
(`web.everyone_sees_all`), so one person's view holds the whole seeded cluster: her run
waiting for approval, her verified run, bob's run on the drained node, the fleet's checks.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from playwright.sync_api import ViewportSize

from tests.browser import REPO, chromium, make_record, page_as, seed_record, web_server

DEFAULT_OUT = REPO / "docs" / "screenshots"
# Wide enough for the tables, as a laptop's browser window; one CSS pixel per pixel keeps
# the files small.
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}


def pages(waiting_lineage: int) -> dict[str, str]:
    """Each picture's file name and the page it shows."""
    return {
        "overview.png": "/",
        "run.png": f"/runs/{waiting_lineage}",
        "approvals.png": "/approvals",
        "nodes.png": "/nodes",
    }


def take(out_dir: Path) -> list[Path]:
    """The pictures, written into `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="medic-screenshots-") as scratch:
        work_dir = Path(scratch)
        url = make_record(work_dir / "medic.db")
        seeded = seed_record(url)
        base = f'[store]\nurl = "{url}"\n'
        with (
            web_server(work_dir / "server", base, "everyone_sees_all = true\n") as server,
            chromium() as browser,
        ):
            context, page = page_as(browser, "alice", server.secret)
            with context:
                page.set_viewport_size(VIEWPORT)
                for name, path in pages(seeded.waiting_lineage).items():
                    response = page.goto(server.url(path))
                    if response is None or response.status != 200:
                        status = "no answer" if response is None else response.status
                        raise RuntimeError(f"{path}: {status}\n{server.log_tail()}")
                    target = out_dir / name
                    page.screenshot(path=str(target), full_page=True)
                    written.append(target)
    return written


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else DEFAULT_OUT
    for path in take(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
