"""Progress where no terminal is: ``ftkit run`` in a CI log prints one plain line per phase,
in order, each with the seconds since the run began, and nothing that redraws."""

from __future__ import annotations

import io
import re
import textwrap

from click.testing import CliRunner
from rich.console import Console

from ftkit.contracts.eventlog import StepRecovered
from ftkit.progress import ProgressEvent
from ftkit.results import ScenarioResult, Verdict
from ftkit.runner.events import progress_line
from ftkit_cli.main import ftkit
from ftkit_cli.render import TOKEN_LINE_INTERVAL_S, RunProgress

from _stub_runner import install_stub_runner

SCENARIO = textwrap.dedent("""\
    name: {name}
    workload:
      prompts: ["the quick brown fox"]
      max_tokens: 8
    faults:
      - kind: oom
        rank: 0
        at: {{request: 0, token: 3}}
    """)

#: What a scenario's run emits, in order (the stub runner replays it).
PHASES = (
    ProgressEvent("", "baseline", "fault-free reference run"),
    ProgressEvent("", "engine_start", "tensor parallel 1"),
    ProgressEvent("", "engine_ready", "engine started in 3.1 s"),
    ProgressEvent("", "tokens", tokens_done=2, tokens_total=8),
    ProgressEvent("", "tokens", tokens_done=4, tokens_total=8),
    ProgressEvent("", "fault", "oom on rank 0 at step 3 (forward, attempt 1)"),
    ProgressEvent("", "recovery", "round 0: recompute in 12 ms"),
    ProgressEvent("", "recovered", "step 3 ran again after 1 failed attempt(s), 12 ms"),
    ProgressEvent("", "done", "pass: every token identical"),
)

LINE = re.compile(r"^\[\s*\d+\.\d+s\] (\S+): (.*)$")


def result_for(name: str, file: str, verdict: Verdict) -> ScenarioResult:
    return ScenarioResult(name=name, file=file, verdict=verdict, reason=f"why {name}",
                          duration_s=2.0)


def test_a_ci_log_gets_one_line_per_phase_in_order(tmp_path, monkeypatch):
    files = []
    for name in ("first", "second"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(SCENARIO.format(name=name))
        files.append(str(path))
    install_stub_runner(monkeypatch, {"first": Verdict.PASS, "second": Verdict.FAIL},
                        result_for, events=PHASES)
    # CliRunner's streams are no terminal, as in a CI log.
    result = CliRunner().invoke(ftkit, ["run", *files])
    assert result.exit_code == 1
    assert "\x1b" not in result.stderr  # no colours, no cursor movement
    assert not re.search("[\u2800-\u28ff\u2500-\u259f]", result.stderr)  # no spinner, no bar
    lines = result.stderr.splitlines()
    assert lines[0] == "ftkit run: 2 scenario(s)"
    logged = [LINE.match(line) for line in lines[1:]]
    assert all(logged), lines
    expected = []
    for name, verdict in (("first", "PASS (2.0 s)"), ("second", "FAIL (2.0 s): why second")):
        expected += [
            (name, f"started: scenario {1 if name == 'first' else 2} of 2"),
            (name, "baseline: fault-free reference run"),
            (name, "engine starting: tensor parallel 1"),
            (name, "engine ready: engine started in 3.1 s"),
            # Token progress: the first line, then not again within the interval.
            (name, "generating: 2/8 tokens"),
            (name, "fault fired: oom on rank 0 at step 3 (forward, attempt 1)"),
            (name, "recovery round: round 0: recompute in 12 ms"),
            (name, "recovered: step 3 ran again after 1 failed attempt(s), 12 ms"),
            (name, f"verdict {verdict}"),
        ]
    assert [(m.group(1), m.group(2)) for m in logged] == expected


def test_the_lines_carry_the_seconds_since_the_run_began():
    now = [100.0]
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RunProgress(console, total=1, clock=lambda: now[0]) as progress:
        progress.start("s")
        now[0] = 112.5
        progress(ProgressEvent("s", "engine_ready", "engine started in 12.5 s"))
        for done, at in ((1, 113.0), (2, 113.0 + TOKEN_LINE_INTERVAL_S / 2),
                         (3, 113.0 + TOKEN_LINE_INTERVAL_S)):
            now[0] = at
            progress(ProgressEvent("s", "tokens", tokens_done=done, tokens_total=3))
    assert out.getvalue().splitlines() == [
        "[    0.0s] s: started: scenario 1 of 1",
        "[   12.5s] s: engine ready: engine started in 12.5 s",
        "[   13.0s] s: generating: 1/3 tokens",
        f"[{13.0 + TOKEN_LINE_INTERVAL_S:7.1f}s] s: generating: 3/3 tokens",
    ]


def test_verbose_in_a_ci_log_prints_every_event():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RunProgress(console, total=1, verbose=True, clock=lambda: 0.0) as progress:
        progress.start("s")
        for event in PHASES:
            progress(event)
    assert len(out.getvalue().splitlines()) == 1 + len(PHASES)


def test_on_a_terminal_there_are_no_timestamped_lines_but_faults_still_show():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with RunProgress(console, total=1) as progress:
        progress.start("s")
        for event in PHASES:
            progress(event)
        progress.finish(result_for("s", "s.yaml", Verdict.PASS))
    text = out.getvalue()
    assert not LINE.search(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))
    assert "fault fired" in text and "recovered" in text and "engine starting" not in text


def test_a_recovered_step_is_a_progress_line_once_from_rank_0():
    event = StepRecovered(rank=0, time=1.0, step=7, rpc_kind="execute", failures=2,
                          recovery_s=0.084, rollback_s=0.001, rerun_s=0.01)
    assert progress_line(event) == ("recovered",
                                    "step 7 ran again after 2 failed attempt(s), 84 ms")
    other = StepRecovered(rank=1, time=1.0, step=7, rpc_kind="execute", failures=2,
                          recovery_s=0.084, rollback_s=0.001, rerun_s=0.01)
    assert progress_line(other) is None
