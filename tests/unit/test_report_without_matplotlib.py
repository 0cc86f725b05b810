"""The library renders its HTML report without matplotlib (a serving environment does not
install it): the timeline figure is replaced by a note that says how to get it, and everything
else of the report is still there. matplotlib's absence is simulated in a fresh interpreter
(``sys.modules["matplotlib"] = None`` makes every import of it fail)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ftkit.report.html import html_report
from ftkit.report.timeline import NO_MATPLOTLIB, TimelineUnavailable, timeline_svg
from ftkit.results import RequestComparison, ScenarioResult, Verdict

RESULT = """
from ftkit.results import RequestComparison, ScenarioResult, Verdict

result = ScenarioResult(
    name="timed", file="scenarios/timed.yaml", verdict=Verdict.PASS, reason="all tokens match",
    duration_s=2.0,
    requests=[RequestComparison(0, [1, 2, 3], [1, 2, 3], None, actual_times=[0.1, 0.2, 0.3])])
"""


def timed_result() -> ScenarioResult:
    return ScenarioResult(
        name="timed", file="scenarios/timed.yaml", verdict=Verdict.PASS,
        reason="all tokens match", duration_s=2.0,
        requests=[RequestComparison(0, [1, 2, 3], [1, 2, 3], None,
                                    actual_times=[0.1, 0.2, 0.3])])


def render_without_matplotlib() -> str:
    code = textwrap.dedent("""
        import sys
        sys.modules["matplotlib"] = None  # import matplotlib now raises ImportError
        """) + RESULT + textwrap.dedent("""
        from ftkit.report.html import html_report
        sys.stdout.write(html_report([result]))
        """)
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, timeout=120).stdout


def test_without_matplotlib_the_report_says_how_to_get_the_timeline():
    page = render_without_matplotlib()
    assert "<svg" not in page
    assert "needs matplotlib" in page and "ftkit[report]" in page and "ftkit report" in page
    # The rest of the report is all there.
    assert "timed" in page and "all tokens match" in page and "</html>" in page


def test_with_matplotlib_the_same_result_has_its_figure():
    pytest.importorskip("matplotlib", reason="matplotlib (the report extra) is not installed")
    page = html_report([timed_result()])
    assert "<figure><svg" in page and "needs matplotlib" not in page


def test_the_timeline_function_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(TimelineUnavailable) as info:
        timeline_svg(timed_result())
    assert str(info.value) == NO_MATPLOTLIB
    # Without token times there is nothing to draw: no matplotlib needed, no error.
    untimed = ScenarioResult(name="u", file="u.yaml", verdict=Verdict.ERROR, reason="no run",
                             duration_s=0.0)
    assert timeline_svg(untimed) is None
