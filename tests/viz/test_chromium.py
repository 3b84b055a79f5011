"""The renderer behind every static image: one Chromium kept warm between images, at the lowest CPU priority."""
import os
import subprocess
import sys
import time

import plotly.graph_objects as go
import pytest

from moelab.viz import chromium, export


def test_lower_priority_reaches_every_descendant_and_never_raises_one(tmp_path):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
            " time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(chromium.descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = chromium.descendants(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2  # the child's child found through /proc
        assert chromium.lower_priority(parent.pid, 10) == 2
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in tree] == [10, 10]
        assert chromium.lower_priority(parent.pid, 5) == 0  # a lower niceness asked for: left at 10
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in tree] == [10, 10]
    finally:
        for p in reversed(chromium.descendants(parent.pid)):
            os.kill(p, 9)
        parent.wait(10)


def _fig(n: int) -> dict:
    return go.Figure(go.Bar(x=list(range(n)), y=[i * i for i in range(n)], name=f"n={n}"),
                     layout={"title": {"text": f"{n} bars"}, "width": 500, "height": 300}).to_dict()


@pytest.mark.timeout(180)
@pytest.mark.skipif(export.find_chromium() is None, reason="no Chromium for kaleido")
def test_one_warm_tab_renders_each_figure_as_a_fresh_page_would(tmp_path, monkeypatch):
    """The tab is not reloaded between images (kaleido reloads plotly.js after each one: half the time), yet
    nothing carries over: a figure drawn after another is byte for byte what it is drawn first."""
    from kaleido._kaleido_tab._tab import _KaleidoTab

    reloads = []
    real_reload = _KaleidoTab.reload

    async def counted(self):
        reloads.append(1)
        return await real_reload(self)

    monkeypatch.setattr(_KaleidoTab, "reload", counted)
    monkeypatch.setenv("BROWSER_PATH", export.find_chromium())
    c = chromium.Chromium()
    try:
        specs = [{"fig": _fig(n), "path": tmp_path / f"{i}_{n}.png", "opts": {"format": "png"}}
                 for i, n in enumerate((3, 12, 3))]
        assert c.render(specs[:1], timeout=120) == ()
        assert c.render(specs[1:], timeout=120) == ()  # a second batch in the same browser
        assert reloads == []
        browser = c._k.subprocess.pid
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in chromium.descendants(browser)} == {chromium.NICE}
        assert c.cpu_s() > 0 and chromium.cpu_seconds(browser) >= c.cpu_s()
    finally:
        c.close()
    first, other, again = (s["path"].read_bytes() for s in specs)
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and first != other
    assert again == first
    assert not c.is_open
