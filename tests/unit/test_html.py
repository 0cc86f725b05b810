"""The HTML report: one self-contained page with the verdict table and a fault timeline."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner
from rich.console import Console

from ftkit.report import (
    SkippedScenario,
    read_json_report,
    table_cells,
    write_html_report,
    write_json_report,
)
from ftkit.report.html import html_report
from ftkit.report.timeline import token_latencies
from ftkit.results import (
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)
from ftkit_cli.main import ftkit
from ftkit_cli.render import VerdictReport

EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)


def times(count: int, *, stall_at: int | None = None) -> list[float]:
    """Token arrival times 20 ms apart, with a 1 s stall before token ``stall_at``."""
    out, now = [], 0.3
    for index in range(count):
        now += 0.02 + (1.0 if index == stall_at else 0.0)
        out.append(round(now, 4))
    return out


def recovered() -> ScenarioResult:
    return ScenarioResult(
        name="oom-decode", file="scenarios/oom-decode.yaml", verdict=Verdict.PASS,
        reason="2 request(s) match the baseline", duration_s=8.0, tokens_per_s=40.0,
        requests=[RequestComparison(index=i, expected=list(range(16)), actual=list(range(16)),
                                    first_divergence=None,
                                    actual_times=times(16, stall_at=5)) for i in range(2)],
        faults=[FaultRecord(kind="oom", rank=0, request=0, token=5, phase="forward", times=2,
                            fired=True, fired_at=FiredAt(0, 5, 6), attempts=2, recovered=True,
                            recovery_s=0.9, at_s=0.42)],
        recoveries=[RecoveryRecord(step=6, kind="oom", decision="recompute", attempt=n,
                                   ranks=[0], duration_s=0.45, at_s=0.42 + 0.45 * (n - 1))
                    for n in (1, 2)],
    )


def diverged() -> ScenarioResult:
    actual = list(range(16))
    actual[9] = 777
    return ScenarioResult(
        name="flap<script>", file="scenarios/flap.yaml", verdict=Verdict.FAIL,
        reason="request 1 diverges at token 9: expected 9, got 777 & <more>", duration_s=6.0,
        requests=[RequestComparison(index=0, expected=list(range(16)), actual=list(range(16)),
                                    first_divergence=None, actual_times=times(16)),
                  RequestComparison(index=1, expected=list(range(16)), actual=actual,
                                    first_divergence=9, actual_times=times(16))],
        faults=[FaultRecord(kind="link_flap", rank=1, request=1, token=8, phase="sample",
                            times=3, fired=True, fired_at=FiredAt(1, 8, 9), attempts=3,
                            at_s=0.45)],
        error="RuntimeError: <gloo> broke",
    )


def untimed() -> ScenarioResult:
    return ScenarioResult(name="never-ran", file="n.yaml", verdict=Verdict.ERROR,
                          reason="the engine did not start", duration_s=0.5)


RESULTS = [recovered(), diverged(), untimed()]
SKIPPED = [SkippedScenario("later", "later.yaml", "not run: --fail-fast stopped after x")]


class _Tables(HTMLParser):
    """The text of every cell of the first table, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._tables = 0
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._tables += 1
        elif tag == "tr" and self._tables == 1:
            self.rows.append([])
        elif tag in ("td", "th") and self._tables == 1:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def verdict_rows(page: str) -> list[list[str]]:
    parser = _Tables()
    parser.feed(page)
    return parser.rows


def svgs(page: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)


def test_page_is_self_contained_with_one_timeline_per_timed_scenario(tmp_path):
    page = write_html_report(RESULTS, tmp_path / "out" / "r.html", skipped=SKIPPED
                             ).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert len(svgs(page)) == 2
    assert "No token times were recorded" in page
    assert not EXTERNAL.search(page)
    assert "<script" not in page and "<link" not in page
    assert not re.search(r"url\((?!#)", page)  # only references inside the page
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page


def test_verdict_table_has_the_cli_columns_and_cells():
    rows = verdict_rows(html_report(RESULTS))
    assert rows[0] == ["scenario", "verdict", "requests", "tokens", "divergence", "faults",
                       "re-inferences", "recovery"]
    assert rows[1:] == [list(table_cells(r)) for r in RESULTS]
    assert rows[2][4] == "req 1 tok 9"


def test_timeline_marks_faults_recoveries_and_the_divergence():
    first, second = svgs(html_report(RESULTS))
    assert "oom rank 0, 2 attempts" in first
    assert "recovery round" in first
    assert "request 1" in first
    assert "link_flap rank 1, 3 attempts" in second
    assert "divergence: request 1 token 9" in second
    assert "recovery round" not in second


def test_divergence_table_shows_expected_and_actual_around_the_token():
    page = html_report(RESULTS)
    assert '<td class="diverged">9</td>' in page
    assert '<td class="diverged">777</td>' in page
    section = page[page.index("<h3>Divergence</h3>"):]
    assert [f"<th>{i}</th>" in section for i in (5, 6, 12, 13)] == [False, True, True, False]


def test_every_text_is_escaped():
    page = html_report(RESULTS, skipped=SKIPPED)
    assert "flap<script>" not in page and "flap&lt;script&gt;" in page
    assert "&lt;gloo&gt; broke" in page
    assert "777 &amp; &lt;more&gt;" in page
    assert "later (later.yaml): not run: --fail-fast" in page
    assert "1 skipped" in page


def test_token_latency_is_the_gap_to_the_previous_token():
    assert token_latencies([0.5, 0.6, 0.6, 1.6]) == [0.5, 0.09999999999999998, 0.0, 1.0]


def test_rendering_is_reproducible_from_the_journal(tmp_path):
    journal = read_json_report(write_json_report(RESULTS, tmp_path / "r.json",
                                                 skipped=SKIPPED))
    assert html_report(journal) == html_report(journal)
    from_results = html_report(RESULTS, skipped=SKIPPED)
    # Only the provenance line (when, on what) may differ between results and journal.
    def body(page):
        return re.sub(r'<p class="meta">created .*?</p>', "", page)
    assert body(html_report(journal)) == body(from_results)


def test_ftkit_report_renders_the_same_table_and_page_from_a_journal(tmp_path):
    journal_path = write_json_report(RESULTS, tmp_path / "r.json", skipped=SKIPPED)
    out_html, out_junit = tmp_path / "again.html", tmp_path / "again.xml"
    result = CliRunner().invoke(ftkit, ["report", str(journal_path), "--html", str(out_html),
                                        "--junit", str(out_junit)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = Console(file=io.StringIO(), width=200, highlight=False)
    shown.print(VerdictReport(RESULTS, skipped=SKIPPED))
    assert result.stdout == shown.file.getvalue()
    assert "1 skipped" in result.stdout
    assert out_html.read_text(encoding="utf-8") == html_report(read_json_report(journal_path))
    assert "<testsuites" in out_junit.read_text(encoding="utf-8")


def test_ftkit_report_rejects_what_is_not_a_journal(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "scenarios": [{"name": "x"}]}))
    result = CliRunner().invoke(ftkit, ["report", str(bad), "--html", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "malformed" in result.stderr and "Traceback" not in result.output
    missing = CliRunner().invoke(ftkit, ["report", str(tmp_path / "missing.json")])
    assert missing.exit_code == 2 and "cannot read the report" in missing.stderr


def test_importing_the_reports_does_not_import_matplotlib():
    code = "import sys, ftkit.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "False"


def test_an_engine_restart_is_shaded_on_the_timeline():
    from ftkit.report.timeline import timeline_svg
    from ftkit.results import FaultRecord, RequestComparison, ScenarioResult, Verdict

    kill = FaultRecord(kind="process_kill", rank=1, request=0, token=3, phase="forward",
                       times=1, fired=True, attempts=1, recovered=True, recovery_s=21.5,
                       restart_s=21.0, at_s=0.4)
    result = ScenarioResult(
        name="kill", file="k.yaml", verdict=Verdict.PASS, reason="ok", duration_s=30.0,
        requests=[RequestComparison(0, [1, 2, 3, 4], [1, 2, 3, 4], None,
                                    actual_times=[0.1, 0.2, 0.3, 22.0])],
        faults=[kill])
    svg = timeline_svg(result)
    assert "engine restart and resumption" in svg
    assert "process_kill rank 1" in svg


# --- a difference other than a token id ----------------------------------------------------

def drifted() -> ScenarioResult:
    """Request 0 sample 1 (of 2): one logprob off at token 2, then a token id at 5."""
    from ftkit.results import RequestOutput
    from ftkit.verify import compare_completion

    expected = RequestOutput(index=0, sample=1, token_ids=list(range(8)),
                             logprobs=[-0.5] * 8, token_times=times(8))
    actual = RequestOutput(index=0, sample=1, token_ids=[0, 1, 2, 3, 4, 55, 6, 7],
                           logprobs=[-0.5, -0.5, -0.5000001] + [-0.5] * 5,
                           token_times=times(8))
    comparison = compare_completion(expected, actual, samples=2)
    return ScenarioResult(name="drift", file="d.yaml", verdict=Verdict.FAIL,
                          reason=comparison.detail or "", duration_s=1.0,
                          requests=[comparison])


def test_a_logprob_drift_is_named_in_the_table_the_section_and_the_timeline():
    page = html_report([drifted()])
    assert verdict_rows(page)[1][4] == "req 0 s1 tok 2 logprob"
    section = page[page.index("<h3>Divergence</h3>"):]
    assert "<p>logprob drift at request 0 sample 1, token 2: -0.5 vs -0.5000001</p>" in section
    assert ('<tr><td class="text">logprobs</td><td>2</td><td class="text">-0.5</td>'
            '<td class="text">-0.5000001</td></tr>') in section
    # The token ids still differ later: the tokens around that one are shown too.
    assert '<td class="diverged">55</td>' in section
    [svg] = svgs(page)
    assert "logprob drift: request 0 sample 1 token 2" in svg


@pytest.mark.parametrize(("fields", "label"), [
    ({"first_divergence": 9}, "req 1 tok 9"),
    ({"first_divergence": 9, "diverged_field": "token_ids", "position": 9}, "req 1 tok 9"),
    ({"diverged_field": "logprobs", "position": 14}, "req 1 tok 14 logprob"),
    ({"diverged_field": "top_logprobs", "position": 3, "sample": 1, "samples": 2},
     "req 1 s1 tok 3 top-k"),
    ({"diverged_field": "prompt_logprobs", "position": 5}, "req 1 prompt 5"),
    ({"diverged_field": "prompt_logprobs"}, "req 1 prompt"),
    ({"diverged_field": "finish_reason"}, "req 1 finish reason"),
    ({"diverged_field": "stop_reason"}, "req 1 stop reason"),
    ({"diverged_field": "text", "position": 40}, "req 1 text"),
])
def test_the_divergence_cell_names_the_field(fields, label):
    from ftkit.report.table import divergence_label

    comparison = RequestComparison(index=1, expected=[1], actual=[1],
                                   **{"first_divergence": None, **fields})
    assert divergence_label(comparison) == label


def test_a_request_with_several_completions_counts_once_in_the_table():
    result = drifted()
    result.requests.append(RequestComparison(index=0, expected=[1], actual=[1],
                                             first_divergence=None, samples=2))
    assert table_cells(result)[2] == "1"


def served() -> ScenarioResult:
    """A serve scenario: two streams and one background stream, one failed."""
    from ftkit.results import ClientView, StreamView

    result = recovered()
    result.name = "served"
    result.client = ClientView(
        api="chat",
        run=[StreamView(0, 16, ttft_s=0.25, max_gap_s=3.5),
             StreamView(1, 9, ttft_s=0.75, max_gap_s=None, error="APIConnectionError: gone"),
             StreamView(0, 16, ttft_s=0.5, max_gap_s=0.125, background=True)],
        baseline=[StreamView(0, 16, ttft_s=0.2, max_gap_s=0.0625),
                  StreamView(1, 16, ttft_s=0.3, max_gap_s=0.05)])
    return result


def test_a_serve_scenario_shows_its_clients_in_every_report(tmp_path):
    from ftkit.report import write_junit_report

    summary = ("clients (chat): 3 stream(s), 1 of them background load; first token within "
               "0.750 s; largest gap between two tokens 3.500 s (fault-free run: 0.062 s); "
               "failed requests 1, retried 0")
    journal = write_json_report([served(), untimed()], tmp_path / "r.json")
    page = html_report(read_json_report(journal))  # what the journal kept
    assert page.count("<h3>Clients</h3>") == 1 and summary in page
    rows = [[re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>.*?</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", page.split("<h3>Clients</h3>")[1]
                                  .split("</table>")[0])]
    assert rows[1:] == [  # rows[0] is the header
        ["faulted", "0", "16", "0.250 s", "3.500 s", "-"],
        ["faulted", "1", "9", "0.750 s", "-", "APIConnectionError: gone"],
        ["faulted", "background", "16", "0.500 s", "0.125 s", "-"],
        ["fault-free", "0", "16", "0.200 s", "0.062 s", "-"],
        ["fault-free", "1", "16", "0.300 s", "0.050 s", "-"]]
    shown = Console(file=io.StringIO(), width=400, highlight=False)
    shown.print(VerdictReport([served(), untimed()]))
    assert f"served: {summary}" in shown.file.getvalue()
    assert shown.file.getvalue().count("clients (") == 1
    junit = write_junit_report([served()], tmp_path / "r.xml").read_text(encoding="utf-8")
    assert summary in junit
