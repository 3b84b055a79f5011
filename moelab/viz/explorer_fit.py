"""Fit the explorer's plotly ``FigureWidget`` s to the notebook's width.

Since plotly 6 a ``FigureWidget`` is an ``anywidget``: it draws into its element before the element is attached
to the page, measures 0 px there and falls back to plotly.js's 700 px default, and it never hears of the
notebook's width again (plotly's own resize handling is in the ipywidgets-era Lumino messages an anywidget does
not receive). Two pieces fix that: each figure gets plotly.js's ``responsive`` config (plotly.js resizes the plot
to its container on a window ``resize`` event), and :class:`Fit`, a zero-height anywidget placed in the
explorer's box, fires that event once it is attached, whenever the box's width changes, and when the kernel
bumps ``tick`` (after a figure was rebuilt in place).
"""
from __future__ import annotations

_ESM = """
function render({ model, el }) {
  const fire = () => requestAnimationFrame(() => window.dispatchEvent(new Event('resize')));
  let last = -1, tries = 0;
  const obs = new ResizeObserver(entries => {
    const w = Math.round(entries[0].contentRect.width);
    if (w > 0 && w !== last) { last = w; fire(); }
  });
  const attach = () => {
    if (el.isConnected && el.parentElement) { obs.observe(el.parentElement); fire(); }
    else if (tries++ < 600) requestAnimationFrame(attach);
  };
  attach();
  model.on('change:tick', fire);
  return () => obs.disconnect();
}
export default { render };
"""


def fit_widget():
    """A :class:`Fit` (or None without ``anywidget``: the figures then keep plotly's default width)."""
    try:
        import anywidget
        import traitlets
    except ImportError:
        return None

    class Fit(anywidget.AnyWidget):
        _esm = _ESM
        tick = traitlets.Int(0).tag(sync=True)

    return Fit()


def responsive(fw):
    """``fw`` (a FigureWidget) resized by plotly.js to its container on a window resize."""
    fw._config = {**(fw._config or {}), "responsive": True}
    return fw


__all__ = ["fit_widget", "responsive"]
