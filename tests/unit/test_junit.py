"""The JUnit XML report, read back as a CI system would: ElementTree and junitparser."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from ftkit.report import (
    SkippedScenario,
    read_json_report,
    write_json_report,
    write_junit_report,
)
from ftkit.results import (
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)


def fault(fired: bool = True) -> FaultRecord:
    return FaultRecord(kind="oom", rank=0, request=0, token=5, phase="forward", times=2,
                       fired=fired, fired_at=FiredAt(0, 5, 6) if fired else None,
                       attempts=2 if fired else 0, recovered=fired,
                       recovery_s=0.4 if fired else None, at_s=0.5 if fired else None)


def rounds() -> list[RecoveryRecord]:
    return [RecoveryRecord(step=6, kind="oom", decision="recompute", attempt=n, ranks=[0],
                           duration_s=0.2, at_s=0.5 + 0.2 * n) for n in (1, 2)]


def result(name: str, verdict: Verdict, *, reason: str = "", error: str | None = None,
           diverge_at: int | None = None) -> ScenarioResult:
    actual = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    if diverge_at is not None:
        actual[diverge_at] = 99
    return ScenarioResult(
        name=name, file=f"scenarios/{name}.yaml", verdict=verdict,
        reason=reason or f"reason for {name}", duration_s=2.5, error=error,
        requests=[RequestComparison(index=0, expected=list(range(1, 11)), actual=actual,
                                    first_divergence=diverge_at,
                                    actual_times=[0.1 * (i + 1) for i in range(10)])],
        faults=[fault(fired=verdict is not Verdict.NOT_APPLIED)],
        recoveries=rounds() if verdict is not Verdict.NOT_APPLIED else [],
    )


def all_verdicts() -> list[ScenarioResult]:
    return [
        result("recovers", Verdict.PASS),
        result("diverges", Verdict.FAIL,
               reason="request 0 diverges at token 6: expected 7, got 99", diverge_at=6),
        result("never-fires", Verdict.NOT_APPLIED),
        result("breaks", Verdict.ERROR, error="RuntimeError: engine died"),
    ]


SKIPPED = [SkippedScenario(name="later", file="scenarios/later.yaml",
                           reason="not run: --fail-fast stopped after diverges (fail)")]


@pytest.fixture
def report_path(tmp_path):
    return write_junit_report(all_verdicts(), tmp_path / "out" / "junit.xml", skipped=SKIPPED)


def cases(root: ET.Element) -> dict[str, ET.Element]:
    return {case.get("name"): case for case in root.iter("testcase")}


def test_counts_and_layout(report_path):
    root = ET.parse(report_path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    for element in (root, suite):
        assert {k: element.get(k) for k in ("tests", "failures", "errors", "skipped")} == \
            {"tests": "5", "failures": "1", "errors": "2", "skipped": "1"}
    assert float(suite.get("time")) == pytest.approx(10.0)
    by_name = cases(root)
    assert list(by_name) == ["recovers", "diverges", "never-fires", "breaks", "later"]
    assert by_name["recovers"].get("classname") == "ftkit.recovers"
    assert by_name["later"].get("classname") == "ftkit.later"
    assert float(by_name["diverges"].get("time")) == pytest.approx(2.5)
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert "python" in properties


def test_each_verdict_maps_to_its_junit_outcome(report_path):
    by_name = cases(ET.parse(report_path).getroot())
    outcome = {name: [child.tag for child in case if child.tag != "system-out"]
               for name, case in by_name.items()}
    assert outcome == {"recovers": [], "diverges": ["failure"], "never-fires": ["error"],
                       "breaks": ["error"], "later": ["skipped"]}
    assert by_name["never-fires"].find("error").get("type") == "not_applied"
    assert by_name["breaks"].find("error").get("type") == "error"
    assert "RuntimeError: engine died" in by_name["breaks"].find("error").text
    assert by_name["later"].find("skipped").get("message").startswith("not run: --fail-fast")


def test_failure_names_the_first_divergence_with_the_tokens_around_it(report_path):
    failure = cases(ET.parse(report_path).getroot())["diverges"].find("failure")
    assert failure.get("message") == "request 0 diverges at token 6: expected 7, got 99"
    lines = failure.text.splitlines()
    assert lines[0] == failure.get("message")
    tokens, expected, actual = (line.split() for line in lines[1:4])
    assert tokens == ["token", "3", "4", "5", "6", "7", "8", "9"]
    assert expected == ["expected", "4", "5", "6", "7", "8", "9", "10"]
    assert actual == ["actual", "4", "5", "6", "99", "8", "9", "10"]


def test_system_out_holds_faults_reinferences_and_recovery(report_path):
    out = cases(ET.parse(report_path).getroot())["recovers"].find("system-out").text
    assert "faults fired: 1/1" in out
    assert "oom on rank 0 at request 0 token 5" in out
    assert "2 attempt(s), recovered in 0.400 s" in out
    assert "re-inferences: 2" in out
    assert "recovery time: 0.400 s in 2 round(s)" in out
    unfired = cases(ET.parse(report_path).getroot())["never-fires"].find("system-out").text
    assert "faults fired: 0/1" in unfired and "did not fire" in unfired


def test_junitparser_reads_the_same_counts(report_path):
    junitparser = pytest.importorskip("junitparser")
    xml = junitparser.JUnitXml.fromfile(str(report_path))
    (suite,) = list(xml)
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (5, 1, 2, 1)
    kinds = {case.name: [type(r).__name__ for r in case.result] for case in suite}
    assert kinds == {"recovers": [], "diverges": ["Failure"], "never-fires": ["Error"],
                     "breaks": ["Error"], "later": ["Skipped"]}


def test_characters_xml_cannot_carry_are_dropped(tmp_path):
    bad = result("ansi", Verdict.ERROR, reason="boom \x1b[31mred\x1b[0m \x00 <&>",
                 error="\x07bell")
    path = write_junit_report([bad], tmp_path / "j.xml")
    error = ET.parse(path).getroot().find(".//error")
    assert error.get("message") == "boom [31mred[0m  <&>"
    assert "bell" in error.text


def test_rendered_again_from_the_json_journal(tmp_path):
    journal = write_json_report(all_verdicts(), tmp_path / "r.json", skipped=SKIPPED,
                                environment={"host": "ci"})
    direct = ET.parse(write_junit_report(all_verdicts(), tmp_path / "a.xml",
                                         skipped=SKIPPED)).getroot()
    again = ET.parse(write_junit_report(read_json_report(journal), tmp_path / "b.xml")
                     ).getroot()
    assert [ET.tostring(c) for c in direct.iter("testcase")] == \
        [ET.tostring(c) for c in again.iter("testcase")]
    assert {p.get("name"): p.get("value") for p in again.iter("property")} == {"host": "ci"}
    assert again.find("testsuite").get("timestamp") == read_json_report(journal)["created_at"]


def test_an_empty_run_is_a_valid_empty_suite(tmp_path):
    root = ET.parse(write_junit_report([], tmp_path / "j.xml")).getroot()
    assert root.get("tests") == "0" and list(root.iter("testcase")) == []


def test_a_failure_on_a_finish_reason_names_the_field_and_both_values(tmp_path):
    from ftkit.results import RequestOutput
    from ftkit.verify import compare_completion

    expected = RequestOutput(index=2, token_ids=[4, 5, 6], finish_reason="length",
                             text="a b c")
    actual = RequestOutput(index=2, token_ids=[4, 5, 6], finish_reason="stop", text="a b c")
    comparison = compare_completion(expected, actual)
    stopped = ScenarioResult(name="stops", file="s.yaml", verdict=Verdict.FAIL,
                             reason=comparison.detail or "", duration_s=1.0,
                             requests=[comparison])
    path = write_junit_report([stopped], tmp_path / "r.xml")
    failure = cases(ET.parse(path).getroot())["stops"].find("failure")
    assert failure.get("message") == "finish reason differs at request 2: 'length' vs 'stop'"
    # No token id differs: no tokens to show around one.
    assert failure.text.splitlines() == [failure.get("message"),
                                         "finish_reason: expected 'length', actual 'stop'"]
