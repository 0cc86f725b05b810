"""``engine.mode: serve``: the format's serving fields, their rules (with file and line), and
the serve runner's pure parts (request arguments, token ids, the client's view, the server's
options). The run itself against a real server: ``tests/serve/test_serve_scenario.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit.config import CONFIG_KEY
from ftkit.contracts.eventlog import SERVER_RANK, EngineReplaced, FaultFired
from ftkit.results import ClientView, ScenarioResult, StreamView, Verdict
from ftkit.runner import serve
from ftkit.runner.events import collect_events
from ftkit.scenario import ScenarioErrors, load_scenario, load_scenario_text

REPO = Path(__file__).resolve().parents[2]

SERVE = """\
name: s
engine: {tensor_parallel_size: 2, mode: serve}
workload:
  prompts: [one two three, four five six]
  max_tokens: 8
  api: completions
  background_streams: 1
faults:
  - {kind: link_flap, rank: 1, at: {request: 1, token: 3}, times: 2}
"""


def problems(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(ScenarioErrors) as info:
        load_scenario_text(text, file="s.yaml")
    return [(e.line, e.field, e.message) for e in info.value.errors]


def test_the_bundled_serve_scenario_loads_as_a_tp2_server_run():
    scenario = load_scenario(REPO / "scenarios" / "serve_link_flap.yaml")
    assert scenario.engine.mode == "serve" and scenario.engine.tensor_parallel_size == 2
    assert (scenario.workload.api, scenario.workload.background_streams) == ("completions", 2)
    assert [str(f.kind) for f in scenario.faults] == ["link_flap", "device_reset"]
    assert scenario.workload.prompt_count() == 4


def test_serve_fields_default_to_todays_offline_run():
    scenario = load_scenario_text(SERVE.replace(", mode: serve", "").replace(
        "  api: completions\n  background_streams: 1\n", ""))
    assert scenario.engine.mode == "offline"
    assert (scenario.workload.api, scenario.workload.background_streams) == ("completions", 0)
    # An offline engine's key has no `mode`: cached baselines of earlier versions still match.
    assert "mode" not in scenario.engine_key()
    assert load_scenario_text(SERVE).engine_key()["mode"] == "serve"


def test_serve_fields_in_an_offline_scenario_are_refused_where_written():
    text = SERVE.replace(", mode: serve", "")
    assert [(line, field) for line, field, _ in problems(text)] == \
        [(6, "workload.api"), (7, "workload.background_streams")]
    assert "set engine.mode serve" in problems(text)[0][2]


def test_a_process_kill_under_a_server_gives_the_server_one_restart_per_kill():
    text = SERVE.replace("{kind: link_flap, rank: 1, at: {request: 1, token: 3}, times: 2}",
                         "{kind: process_kill, rank: 1, at: {request: 1, token: 3}}")
    settings = serve.server_options(load_scenario_text(text), 8000, "/events")  # valid
    recovery = json.loads(settings[settings.index("--additional-config") + 1])[CONFIG_KEY]
    assert recovery["max_restarts"] == 1
    without = serve.server_options(load_scenario_text(SERVE), 8000, "/events")
    assert "max_restarts" not in json.loads(
        without[without.index("--additional-config") + 1])[CONFIG_KEY]


def test_the_servers_engine_replacements_are_the_runs_restarts():
    replaced = EngineReplaced(error="EngineDeadError", restart_s=4.5, standby=False,
                              rank=SERVER_RANK, time=1010.0)
    other = FaultFired(run_id=None, index=0, kind="process_kill", request=1, token=3,
                       phase="forward", step=9, attempt=1, pid=7, rank=1, time=1000.0)
    [restart] = serve.server_restarts([other, replaced], origin=1000.0)
    assert (restart.died_at_s, restart.restart_s, restart.resumed_at_s) == (5.5, 4.5, 10.0)
    assert restart.error == "EngineDeadError"
    # The kill, recovered by that restart.
    spec = load_scenario_text(SERVE.replace(
        "{kind: link_flap, rank: 1, at: {request: 1, token: 3}, times: 2}",
        "{kind: process_kill, rank: 1, at: {request: 1, token: 3}}")).faults
    [record], _ = collect_events([other, replaced], spec[:1], origin=1000.0,
                                 restarts=[restart])
    assert record.fired and record.recovered and record.restart_s == 4.5
    [unrecovered], _ = collect_events([other], spec[:1], origin=1000.0)
    assert unrecovered.fired and not unrecovered.recovered


def test_a_fault_fired_in_a_server_is_reported_at_the_request_it_was_planned_for():
    """The workers say request 0 for every served request (they know only its id); the
    record says the scenario's request, and the token and step the workers saw."""
    fired = FaultFired(run_id=None, index=0, kind="link_flap", request=0, token=3,
                       phase="forward", step=9, attempt=1, pid=7, rank=1, time=1000.0)
    spec = load_scenario_text(SERVE).faults
    assert spec[0].at.request == 1
    [record], _ = serve.served_fault_records([fired], spec[:1], origin=1000.0, restarts=[])
    assert (record.fired_at.request, record.fired_at.token, record.fired_at.step) == (1, 3, 9)
    [offline], _ = collect_events([fired], spec[:1], origin=1000.0)
    assert offline.fired_at.request == 0  # what the served record would say without it
    [unfired], _ = serve.served_fault_records([], spec[:1], origin=1000.0, restarts=[])
    assert unfired.fired_at is None


def test_a_serve_scenario_needs_recovery_on():
    text = SERVE + "recovery: {enabled: false}\nexpect: {outcome: failed}\n"
    assert [(f, "injection route" in m) for _, f, m in problems(text)] == \
        [("recovery.enabled", True)]


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("logprobs", 3),
                                              ("prompt_logprobs", 1)])
def test_fields_the_streams_do_not_compare_are_refused(field, value):
    text = SERVE.replace("  api: completions\n", f"  api: completions\n  temperature: 0.5\n"
                                                  f"  seed: 1\n  sampling: {{{field}: {value}}}\n")
    found = [(f, m) for _, f, m in problems(text) if f == f"workload.sampling.{field}"]
    assert found and "not supported with engine.mode serve" in found[0][1]


def test_unknown_api_and_negative_background_streams_are_type_errors():
    fields = {f for _, f, _ in problems(SERVE.replace("api: completions", "api: embeddings")
                                        .replace("background_streams: 1",
                                                 "background_streams: -1"))}
    assert fields == {"workload.api", "workload.background_streams"}


# --- the runner's pure parts --------------------------------------------------------------

def test_request_arguments_ask_for_token_ids_and_the_sampled_logprob():
    sampling = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True,
                "logit_bias": {5: 2.0}}
    completions = serve.request_arguments("completions", "hi there", sampling)
    assert completions["prompt"] == "hi there" and completions["logprobs"] == 1
    assert completions["stream"] is True
    body = completions["extra_body"]
    assert body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True
    assert body["logit_bias"] == {"5": 2.0} and body["max_tokens"] == 8
    chat = serve.request_arguments("chat", "hi there", sampling)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}]
    assert chat["logprobs"] is True and "prompt" not in chat


def test_token_ids_are_read_from_vllms_token_id_form():
    assert serve.token_id("token_id:1234") == 1234
    with pytest.raises(Exception, match="return_tokens_as_token_ids"):
        serve.token_id("hello")


def test_a_streams_view_has_its_time_to_first_token_and_largest_gap():
    stream = serve.Stream(request=1, token_ids=[1, 2, 3, 4], sent_at=0.5,
                          token_times=[1.0, 1.25, 3.0, 3.5])
    view = stream.view()
    assert view.ttft_s == pytest.approx(0.5) and view.max_gap_s == pytest.approx(1.75)
    assert view.tokens == 4 and view.error is None
    empty = serve.Stream(request=0, sent_at=0.1, error="APIConnectionError: x").view()
    assert (empty.ttft_s, empty.max_gap_s, empty.error) == (None, None, "APIConnectionError: x")


def test_the_client_view_sums_the_faulted_run_and_round_trips_through_the_report():
    view = ClientView(api="completions", run=[
        StreamView(request=0, tokens=8, ttft_s=0.2, max_gap_s=1.5),
        StreamView(request=1, tokens=3, ttft_s=0.4, max_gap_s=0.1, error="boom"),
        StreamView(request=0, tokens=8, ttft_s=0.3, max_gap_s=0.2, background=True)],
        baseline=[StreamView(request=0, tokens=8, ttft_s=0.1, max_gap_s=0.05)])
    assert (view.max_ttft_s, view.max_gap_s, view.failed_requests) == (0.4, 1.5, 1)
    raw = json.loads(json.dumps(view.to_dict()))
    assert raw["failed_requests"] == 1 and raw["baseline_max_gap_s"] == 0.05
    assert ClientView.from_dict(raw) == view
    from ftkit.report.journal import _scenario_from_dict

    result = ScenarioResult(name="s", file="f", verdict=Verdict.PASS, reason="",
                            duration_s=1.0, client=view)
    assert _scenario_from_dict(json.loads(json.dumps(result.to_dict()))).client == view
    offline = ScenarioResult(name="s", file="f", verdict=Verdict.PASS, reason="", duration_s=1)
    assert offline.to_dict()["client"] is None


def test_the_servers_options_carry_the_engine_settings_and_injection():
    scenario = load_scenario_text(SERVE.replace("mode: serve", "mode: serve, args: "
                                                "{max_num_seqs: 8, enable_prefix_caching: "
                                                "false}"))
    options = serve.server_options(scenario, 8123, "/tmp/x")
    assert options[options.index("--tensor-parallel-size") + 1] == "2"
    assert options[options.index("--port") + 1] == "8123"
    assert options[options.index("--host") + 1] == "127.0.0.1"
    config = json.loads(options[options.index("--additional-config") + 1])["fault_tolerance"]
    assert config["enabled"] and config["injection"] and config["event_log_dir"] == "/tmp/x"
    assert config["max_reinference"] == scenario.recovery.max_reinference
    assert "--enforce-eager" in options  # ftkit's default, as offline
    assert options[options.index("--max-num-seqs") + 1] == "8"
    assert "--no-enable-prefix-caching" in options


def test_a_serve_scenario_never_reaches_the_engine_hosts(monkeypatch):
    from ftkit.runner import ScenarioRunner

    seen = []

    def fake(scenario, *, file, model_dir, on_event):
        seen.append((scenario.name, file))
        return ScenarioResult(name=scenario.name, file=file, verdict=Verdict.PASS, reason="",
                              duration_s=0.0)

    monkeypatch.setattr(serve, "run_serve_scenario", fake)
    monkeypatch.setattr("ftkit.runner.core.resolve_model", lambda model: "/models/tiny")
    monkeypatch.setattr("ftkit.runner.core.HostClient", None)  # any host use would fail
    with ScenarioRunner() as runner:
        result = runner.run(load_scenario_text(SERVE), file="s.yaml")
    assert result.verdict == Verdict.PASS and seen == [("s", "s.yaml")]
