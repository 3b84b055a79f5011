"""README.md's table of the papers counts each paper's manifest items as they are: "A of B / C" says A items
with products of the B in ``experiments/<paper>/manifest.yaml``, C marked NOT REPRODUCED; every paper with a
manifest has its row (found by its notebook, ``notebooks/<paper>.ipynb``)."""
from __future__ import annotations

import re

import pytest

from moelab.papers.kit.manifest import load_manifest
from moelab.runtime.project import project_root

ROOT = project_root()
PAPERS = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/manifest.yaml"))
ROW = re.compile(r"^\|[^|]*\|\s*`notebooks/(?P<paper>[\w-]+)\.ipynb`\s*\|\s*(?P<made>\d+) of (?P<items>\d+)"
                 r"\s*/\s*(?P<not>\d+)\b")


def readme_counts() -> dict:
    """paper -> (with products, items, not reproduced) as README.md's table of the papers reads."""
    rows = (ROW.match(line) for line in (ROOT / "README.md").read_text().splitlines())
    return {m["paper"]: (int(m["made"]), int(m["items"]), int(m["not"])) for m in rows if m}


def manifest_counts(paper: str) -> tuple:
    items = load_manifest(paper).items
    made = sum(bool(it.products) for it in items)
    return made, len(items), sum(not it.products for it in items)


def test_every_paper_with_a_manifest_has_a_row_and_no_row_is_without_one():
    assert PAPERS and sorted(readme_counts()) == PAPERS


@pytest.mark.parametrize("paper", PAPERS)
def test_the_readme_counts_the_manifest_items(paper):
    assert readme_counts().get(paper) == manifest_counts(paper), (
        f"README.md's row for {paper} should read "
        "{0} of {1} / {2}".format(*manifest_counts(paper)) + f" (experiments/{paper}/manifest.yaml)")
