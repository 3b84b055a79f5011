"""Hecate's Table 1 counted by the paper's rule (the notebook's smoke execution is in
tests/e2e/test_paper_notebooks.py)."""
from __future__ import annotations


def test_table1_counts_the_papers_params():
    from moelab.papers.hecate.common import table1

    t = table1()
    assert t.matches_paper.all(), t[["model", "params_B", "paper_params_B"]]
    assert (t.params == t.layers * (4 * t.experts + 4) * t.d_model ** 2).all()


def test_table1_paper_column_is_read_from_paper_yaml():
    """Table 1's paper column is paper.yaml's numbers (the core holds no copy of them)."""
    import moelab.models.params as params
    from moelab.papers.hecate.common import TABLE1_PARAMS_KEYS, table1
    from moelab.papers.kit.compare import paper_value

    t = table1().set_index("model")
    for model, key in TABLE1_PARAMS_KEYS.items():
        assert t.paper_params_B[model] == paper_value("hecate", key) / 1e9
    assert not [n for n in vars(params) if n.startswith("HECATE")]


def test_every_headline_claim_has_a_row_of_its_own_quantity():
    """The abstract's and introduction's numbers (``headline: true``) each name a moelab source whose product declares
    the paper's quantity and unit (no row is refused), or say why moelab has none."""
    from moelab.papers.kit.compare import compare, load_numbers
    from moelab.papers.kit.registry import products

    numbers = load_numbers("hecate")
    head = {k for k, e in numbers.items() if e.get("headline")}
    assert {"speedup_up_to", "rm_speedup_up_to", "a16_vs_ep_min", "a16_vs_ep_max", "b_vs_ep_min", "b_vs_ep_max",
            "rm_param_cut", "m1_imbalance_slowdown", "m2_flexmoe_speedup", "m3_smartmoe_best_interval"} <= head
    assert all(numbers[k].get("moelab") or numbers[k].get("no_counterpart") for k in head)
    rows = compare("hecate", {}, products("hecate", "moelab.papers.hecate.products"), numbers)
    assert not len(rows[rows.status == "refused"]), rows[rows.status == "refused"][["key", "note"]]
    assert set(rows[rows.headline].key) == head
