"""Shared pytest hooks: the browser tests' screenshots are named at the end of the run (CI log)."""


def pytest_terminal_summary(terminalreporter):
    import sys

    kit = sys.modules.get("browser_kit")
    shots = getattr(kit, "ARTIFACTS", [])
    if shots:
        terminalreporter.write_sep("-", "browser screenshots")
        for p in shots:
            terminalreporter.write_line(str(p))
