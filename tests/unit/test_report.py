"""The JSON journal written by ``ftkit.report``, read back as a user's tool would."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys

import pytest

from ftkit.errors import FtkitError
from ftkit.report import environment_info, read_json_report, write_json_report
from ftkit.results import (
    FaultRecord,
    FiredAt,
    RecoveryRecord,
    RequestComparison,
    ScenarioResult,
    Verdict,
)


def passed() -> ScenarioResult:
    return ScenarioResult(
        name="link-flap", file="scenarios/link_flap.yaml", verdict=Verdict.PASS,
        reason="2 request(s) match the baseline", duration_s=3.25,
        requests=[RequestComparison(index=0, expected=[1, 2, 3], actual=[1, 2, 3],
                                    first_divergence=None)],
        faults=[FaultRecord(kind="link_flap", rank=1, request=0, token=2, phase="forward",
                            times=2, fired=True, fired_at=FiredAt(request=0, token=2, step=5),
                            attempts=2, recovered=True, recovery_s=0.12)],
        recoveries=[RecoveryRecord(step=5, kind="link_flap", decision="recompute", attempt=1,
                                   ranks=[0, 1], duration_s=0.05),
                    RecoveryRecord(step=5, kind="link_flap", decision="recompute", attempt=2,
                                   ranks=[0, 1], duration_s=0.07)],
        tokens_per_s=120.0,
    )


def failed() -> ScenarioResult:
    return ScenarioResult(
        name="broken", file="b.yaml", verdict=Verdict.FAIL,
        reason="request 1 diverges at token 4: expected 5, got 9", duration_s=1.0,
        requests=[RequestComparison(index=0, expected=[1], actual=[1], first_divergence=None),
                  RequestComparison(index=1, expected=[1, 2, 3, 4, 5], actual=[1, 2, 3, 4, 9],
                                    first_divergence=4)],
        faults=[FaultRecord(kind="link_break", rank="all", request=0, token=1,
                            phase="sample", times=1)],
    )


def test_report_round_trip(tmp_path):
    path = write_json_report([passed(), failed()], tmp_path / "out" / "report.json",
                             environment={"host": "ci"})
    report = read_json_report(path)
    assert report["version"] == 1
    assert report["ftkit"]
    assert report["environment"] == {"host": "ci"}
    assert report["summary"] == {"total": 2, "pass": 1, "fail": 1, "not_applied": 0,
                                 "error": 0}

    ok, bad = report["scenarios"]
    assert ok["name"] == "link-flap"
    assert ok["file"] == "scenarios/link_flap.yaml"
    assert ok["verdict"] == "pass"
    assert ok["duration_s"] == 3.25
    assert ok["first_divergence"] is None
    assert ok["reinferences"] == 2
    assert ok["recovery_s"] == pytest.approx(0.12)
    assert ok["first_mismatch"] is None
    assert ok["requests"] == [{"index": 0, "expected": [1, 2, 3], "actual": [1, 2, 3],
                               "first_divergence": None, "actual_times": [], "sample": 0,
                               "samples": 1, "diverged_field": None, "position": None,
                               "expected_value": None, "actual_value": None,
                               "detail": None}]
    fault = ok["faults"][0]
    assert fault["kind"] == "link_flap"
    assert fault["rank"] == 1
    assert fault["fired"] is True
    assert fault["fired_at"] == {"request": 0, "token": 2, "step": 5}
    assert fault["attempts"] == 2
    assert fault["recovered"] is True
    assert fault["recovery_s"] == 0.12

    assert bad["verdict"] == "fail"
    assert bad["reason"].startswith("request 1 diverges at token 4")
    assert bad["first_divergence"] == {"request": 1, "token": 4}
    # A comparison made before the other fields were compared names the token ids.
    assert bad["first_mismatch"] == {"request": 1, "sample": 0, "field": "token_ids",
                                     "position": 4, "expected": None, "actual": None,
                                     "detail": "request 1 diverges at token 4: expected 5, "
                                               "got 9"}
    assert bad["faults"][0]["rank"] == "all"
    assert bad["faults"][0]["fired_at"] is None


def test_default_environment_is_filled(tmp_path):
    report = read_json_report(write_json_report([], tmp_path / "r.json"))
    env = report["environment"]
    assert env["ftkit"] == report["ftkit"]
    assert env["python"].count(".") == 2
    assert {"vllm", "torch", "platform"} <= env.keys()
    assert report["scenarios"] == []
    assert report["summary"]["total"] == 0


def test_write_replaces_an_existing_report(tmp_path):
    path = tmp_path / "r.json"
    write_json_report([passed(), failed()], path)
    write_json_report([failed()], path)
    assert [s["name"] for s in read_json_report(path)["scenarios"]] == ["broken"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("content", ["not json", "[]", '{"version": 2, "scenarios": []}'])
def test_read_rejects_what_is_not_a_v1_report(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(FtkitError, match="r.json"):
        read_json_report(path)


def test_environment_info_does_not_import_vllm_or_torch():
    code = ("import sys, json; from ftkit.report import environment_info; "
            "info = environment_info(); "
            "print(json.dumps([info, 'vllm' in sys.modules, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    info, vllm_imported, torch_imported = json.loads(out)
    assert (vllm_imported, torch_imported) == (False, False)
    assert info["vllm"] is not None
    assert info["torch"] is not None
    assert info == environment_info()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_reports_get_the_mode_of_any_new_file_under_the_umask(tmp_path, umask, mode):
    """CI uploads reports as another user: under umask 022 they are world-readable, not the
    0600 of a temporary file."""
    from ftkit.report import write_html_report, write_junit_report

    old = os.umask(umask)
    try:
        paths = [write_json_report([passed(), failed()], tmp_path / "r.json"),
                 write_junit_report([passed()], tmp_path / "r.xml"),
                 write_html_report([passed()], tmp_path / "r.html")]
    finally:
        os.umask(old)
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in paths} == {oct(mode)}


def drifted() -> ScenarioResult:
    """A real comparison: request 0 sample 1 (of 2) has one logprob one ulp off at token 2,
    in a workload that asks for the top 20 of every position."""
    from ftkit.results import RequestOutput
    from ftkit.verify import compare_completion

    top = [[[token, -0.5], *[[900 + rank, -3.0 - rank] for rank in range(19)]]
           for token in range(8)]
    expected = RequestOutput(index=0, sample=1, token_ids=list(range(8)),
                             logprobs=[-0.5] * 8, top_logprobs=top)
    actual = RequestOutput(index=0, sample=1, token_ids=list(range(8)),
                           logprobs=[-0.5, -0.5, math.nextafter(-0.5, 0.0)] + [-0.5] * 5,
                           top_logprobs=top)
    comparison = compare_completion(expected, actual, samples=2)
    return ScenarioResult(name="drift", file="d.yaml", verdict=Verdict.FAIL,
                          reason=comparison.detail or "", duration_s=1.0,
                          requests=[comparison])


def test_the_journal_names_the_field_position_and_values_of_the_first_mismatch(tmp_path):
    from ftkit.report import results_from_report

    report = read_json_report(write_json_report([drifted()], tmp_path / "r.json"))
    [entry] = report["scenarios"]
    assert entry["first_divergence"] is None  # the token ids match
    assert entry["first_mismatch"] == {
        "request": 0, "sample": 1, "field": "logprobs", "position": 2,
        "expected": -0.5, "actual": math.nextafter(-0.5, 0.0),
        "detail": f"logprob drift at request 0 sample 1, token 2: -0.5 vs "
                  f"{math.nextafter(-0.5, 0.0)!r}"}
    [request] = entry["requests"]
    assert (request["diverged_field"], request["position"]) == ("logprobs", 2)
    # The logprobs of the first difference, not the whole arrays of every position.
    assert "logprobs" not in request and "top_logprobs" not in request
    [back] = results_from_report(report)
    assert back.first_mismatch.detail == entry["first_mismatch"]["detail"]
    assert back.first_mismatch.actual_value == math.nextafter(-0.5, 0.0)
