"""The report page and a section as one file share their HTML through moelab.papers.kit.html's public names."""
import ast
from pathlib import Path

import moelab.papers.kit as kit

KIT = Path(kit.__file__).parent
REPORT_HTML = ("page", "publish", "html")


def test_the_report_html_modules_import_no_private_name_of_each_other():
    for name in REPORT_HTML:
        tree = ast.parse((KIT / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in {f"moelab.papers.kit.{m}" for m in REPORT_HTML}:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name}.py imports {private} from {node.module}"


def test_html_blocks_escape_what_they_show(tmp_path):
    from moelab.papers.kit.html import badge, esc, fmt_s, params_table, url

    assert esc(None) == "" and esc("<b>&") == "&lt;b&gt;&amp;"
    assert badge("<x>", 'a"b') == '<span class="badge a&quot;b">&lt;x&gt;</span>'
    assert url("figures/a b/c&d.html") == "figures/a%20b/c%26d.html"
    assert (fmt_s(None), fmt_s(3.14), fmt_s(300)) == ("?", "3.1 s", "5.0 min")
    table = params_table({"parameters": {"scale": "<smoke>"}, "declared": {"seed": {"default": 0, "type": "int"}}})
    assert "&lt;smoke&gt;" in table and "0 (default)" in table and "<smoke>" not in table
