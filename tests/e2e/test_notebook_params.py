"""Every notebook's parameters are self-describing: ``papermill --help-notebook`` shows each one with its
type and its comment, so a user can drive any notebook headless without opening it."""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
PARAM = re.compile(r"^(?P<name>\w+): (?P<type>\w+) = (?P<value>.+?)  # (?P<help>\S.*)$")


def _parameter_lines(nb: Path) -> list[str]:
    cells = [c for c in json.loads(nb.read_text())["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{nb.name}: expected one cell tagged 'parameters', found {len(cells)}"
    return [ln for ln in "".join(cells[0]["source"]).splitlines() if ln.strip()]


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_help_notebook_shows_every_parameter_with_type_and_comment(nb):
    click = pytest.importorskip("click.testing")
    from papermill.cli import papermill

    lines = _parameter_lines(nb)
    bad = [ln for ln in lines if not PARAM.match(ln)]
    assert not bad, f"{nb.name}: parameter lines need 'name: type = value  # what it means': {bad}"
    result = click.CliRunner().invoke(papermill, ["--help-notebook", str(nb)])
    assert result.exit_code == 0, result.output
    shown = _words(result.output)
    assert f"Parameters inferred for notebook '{nb}'" in shown
    for ln in lines:
        m = PARAM.match(ln)
        assert f"{m['name']}: {m['type']} (default" in shown, f"{nb.name}: {m['name']} not shown with its type"
        assert _words(m["help"]) in shown, f"{nb.name}: {m['name']}'s comment not shown"
