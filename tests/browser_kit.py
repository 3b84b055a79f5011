"""A real JupyterLab and a real Chromium for the browser tests (``-m browser``).

:func:`jupyter_lab` starts ``jupyter lab --no-browser`` on a loopback port with a token, with its own
config/settings/runtime folders (nothing of the user's is read or written), and stops it and every kernel
it started whatever happens. :func:`chromium` drives the system Chromium (``$BROWSER_PATH``, else
``chromium`` on PATH: the one figure export uses) through Playwright, so no browser is downloaded.
The ``Notebook`` helpers click JupyterLab's own menus and read its DOM.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS: list[Path] = []  # screenshots, listed at the end of the pytest run (conftest.py)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
# JupyterLab settings for a test: every cell in the DOM (no virtual scrolling), no news pop-up
SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                                "checkForUpdates": False}}


def chromium_path() -> str | None:
    """The Chromium figure export uses too: ``$BROWSER_PATH``, else ``chromium`` & co. on PATH."""
    from moelab.viz.export import find_chromium

    return find_chromium()


def artifacts_dir() -> Path:
    """Where screenshots go: ``MOELAB_TEST_ARTIFACTS`` or ``test-artifacts/`` in the repository."""
    d = Path(os.environ.get("MOELAB_TEST_ARTIFACTS") or REPO / "test-artifacts") / "browser"
    d.mkdir(parents=True, exist_ok=True)
    return d


def screenshot(page, name: str, max_height: int = 7000) -> Path:
    """The whole open notebook (the viewport grown to its height, up to ``max_height``), or the page."""
    path = artifacts_dir() / f"{name}.png"
    size = page.viewport_size
    tall = page.evaluate("""() => { const p = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
        if (!p) return 0; p.scrollTop = 0; return p.scrollHeight; }""")
    if tall:
        page.set_viewport_size({"width": size["width"], "height": min(max(tall + 150, size["height"]), max_height)})
        page.wait_for_timeout(800)  # plots resize
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(size)
    ARTIFACTS.append(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    log: Path

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def open_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"  # reset: only this notebook open


@contextmanager
def jupyter_lab(root: Path, home: Path, env: dict | None = None, start_timeout: float = 90):
    """A JupyterLab server on 127.0.0.1 serving ``root``; its own folders under ``home``."""
    port, token = _free_port(), secrets.token_hex(16)
    for name, value in SETTINGS.items():
        p = home / "settings" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))
    env = {**os.environ, **(env or {}), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "OMP_NUM_THREADS": "1"}
    log = home / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
           "--LabApp.news_url=", *(["--allow-root"] if os.geteuid() == 0 else [])]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", token, root, log)
    try:
        end = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                lab.api("status")
                break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(f"jupyter lab did not answer in {start_timeout}s:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield lab
    finally:
        _stop(proc, lab, home / "runtime")


def _stop(proc: subprocess.Popen, lab: Lab, runtime: Path) -> None:
    """Shut the kernels down through the API, stop the server, then kill whatever is left of either."""
    import psutil

    try:
        for k in lab.api("kernels") or []:
            lab.api(f"kernels/{k['id']}", method="DELETE")
    except OSError:
        pass
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for p in psutil.process_iter(["cmdline"]):  # a kernel the server did not stop (its connection file)
        if str(runtime) in " ".join(p.info["cmdline"] or []):
            p.kill()


@contextmanager
def chromium(width: int = 1400, height: int = 1000):
    """A Playwright page in the system Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


# ---- a notebook in JupyterLab ------------------------------------------------------------------------------
class Notebook:
    """One open notebook: run it through the menus, wait for it, read its outputs."""

    def __init__(self, page, lab: Lab, name: str):
        self.page, self.lab, self.name = page, lab, name
        page.goto(lab.open_url(name))
        page.locator(".jp-NotebookPanel:visible .jp-Notebook").first.wait_for()
        self.wait_idle(120)

    def kernel_ready(self) -> bool:
        """The server has this notebook's session and its kernel is idle (the toolbar says idle early)."""
        return any(s["path"] == self.name and s["kernel"]["execution_state"] == "idle"
                   for s in self.lab.api("sessions")) and self.kernel_status() == "idle"

    def dialog(self) -> str | None:
        """The text of an open JupyterLab dialog, if any."""
        d = self.page.locator(".jp-Dialog")
        return d.first.inner_text() if d.count() else None

    def menu(self, *path: str) -> None:
        """Click a main-menu path, e.g. ``menu("Run", "Run All Cells")``; an open dialog is an error."""
        if self.dialog():
            raise AssertionError(f"{self.name}: a dialog is open: {self.dialog()!r}")
        self.page.locator("#jp-MainMenu").get_by_text(path[0], exact=True).click()
        for item in path[1:]:
            self.page.locator(".lm-Menu:visible").get_by_text(item, exact=True).last.click()

    def kernel_status(self) -> str:
        ind = self.page.locator(".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator")
        return ind.first.get_attribute("data-status") or "" if ind.count() else ""

    def wait_idle(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not self.kernel_ready():
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: the kernel is not idle after {timeout}s ({self.kernel_status()})")
            time.sleep(0.25)

    def prompts(self) -> list[str]:
        return self.page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()

    def run_all(self, timeout: float) -> None:
        """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle."""
        self.wait_idle(120)  # a kernel still starting would miss the request
        self.menu("Run", "Run All Cells")
        end = time.monotonic() + timeout
        started = time.monotonic() + 10
        while not any("*" in p for p in self.prompts()) and time.monotonic() < started:
            time.sleep(0.05)  # the cells are queued ([*]) when the request has reached the kernel
        while any("*" in p for p in self.prompts()) or self.kernel_status() != "idle":
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: still running after {timeout}s; prompts {self.prompts()}")
            time.sleep(0.5)

    def errors(self) -> list[str]:
        """The text of every error output (a cell that raised)."""
        return self.page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]'
                                 ).all_inner_texts()

    def cell_outputs(self, index: int) -> str:
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


# ---- a static page (the report) ------------------------------------------------------------------------------
def check_report(page, index: Path, drawn: int = 12) -> dict:
    """Open ``index`` (file://) and check it whole: every image loads, every in-page anchor has its target,
    every relative link names an existing file, every linked figure HTML is a plotly page, and ``drawn``
    of them spread over the report (``drawn=None``: all) draw their plot without a script error. Returns
    what was checked; raises AssertionError listing every problem."""
    from urllib.parse import unquote, urlsplit

    errors: list = []
    page.on("pageerror", lambda e: errors.append(f"script error on {page.url}: {e}"))
    page.goto(index.resolve().as_uri())
    page.wait_for_load_state("load")
    page.evaluate("() => document.querySelectorAll('img[loading=lazy]').forEach(i => { i.loading = 'eager'; })")
    page.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
    images = page.evaluate("() => document.images.length")
    broken = page.evaluate("() => Array.from(document.images).filter(i => !i.naturalWidth).map(i => i.src)")
    errors += [f"image does not load: {src}" for src in broken]
    hrefs = page.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))")
    figures = []
    for href in hrefs:
        if href.startswith("#"):
            if not page.locator(f"[id='{unquote(href[1:])}']").count():
                errors.append(f"anchor without a target: {href}")
            continue
        if urlsplit(href).scheme:  # an outside page (plotly.com in an inlined figure): not the report's to check
            continue
        target = index.parent / unquote(urlsplit(href).path)
        if not target.is_file():
            errors.append(f"broken link: {href}")
        elif target.suffix == ".html" and "/figures/" in target.as_posix():
            figures.append(target)
    figures = sorted(set(figures))
    shot = screenshot_page(page, "report")
    errors += [f"figure is not a plotly page: {f}" for f in figures
               if "Plotly.newPlot" not in f.read_text(errors="replace")]
    for fig in figures[::max(1, -(-len(figures) // (drawn or len(figures) or 1)))]:
        page.goto(fig.as_uri())
        try:
            page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=15_000)
        except Exception:  # noqa: BLE001 - collected and reported with the others
            errors.append(f"figure does not draw: {fig}")
    assert not errors, "\n".join(errors)
    return {"images": images, "links": len(hrefs), "figures": len(figures), "screenshot": shot}


def screenshot_element(locator, name: str) -> Path:
    """One element of a page (e.g. a table), whole, into the artifacts folder."""
    path = artifacts_dir() / f"{name}.png"
    locator.scroll_into_view_if_needed()
    locator.screenshot(path=str(path))
    ARTIFACTS.append(path)
    return path


@contextmanager
def offline(page):
    """Block every request that would leave the machine (anything but file: and data: URLs) and list them:
    ``with offline(page) as attempted: ...; assert attempted == []``."""
    attempted: list[str] = []

    def handle(route):
        url = route.request.url
        if url.startswith(("file:", "data:", "blob:", "about:")):
            return route.continue_()
        attempted.append(url)
        return route.abort()

    page.route("**/*", handle)
    page.context.set_offline(True)
    try:
        yield attempted
    finally:
        page.context.set_offline(False)
        page.unroute("**/*")


def screenshot_page(page, name: str, max_height: int = 9000) -> Path:
    """A page's top ``max_height`` pixels (a long report stays a readable picture)."""
    path = artifacts_dir() / f"{name}.png"
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.evaluate("() => window.scrollTo(0, 0)")
    page.screenshot(path=str(path), full_page=True,
                    clip={"x": 0, "y": 0, "width": page.viewport_size["width"], "height": min(height, max_height)})
    ARTIFACTS.append(path)
    return path
