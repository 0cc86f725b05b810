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


DATA_PARALLEL = """\
name: dp
engine: {tensor_parallel_size: 1, mode: serve, args: {data_parallel_size: 2}}
workload:
  prompts: [one two three, four five six]
  max_tokens: 8
faults:
  - {kind: device_reset, rank: all, at: {request: 1, token: 3}}
"""


def test_the_bundled_data_parallel_scenario_serves_two_replicas_with_faults_on_rank_all():
    scenario = load_scenario(REPO / "scenarios" / "serve_data_parallel.yaml")
    assert (scenario.engine.data_parallel_size, scenario.engine.ranks) == (2, 2)
    assert {f.rank for f in scenario.faults} == {"all"}
    options = serve.server_options(scenario, 8000, "/events")
    assert options[options.index("--data-parallel-size") + 1] == "2"
    # Tensor parallel 2 in each of two replicas: four ranks a fault may name.
    wider = load_scenario_text(DATA_PARALLEL.replace("tensor_parallel_size: 1",
                                                     "tensor_parallel_size: 2"))
    assert wider.engine.ranks == 4


def test_data_parallelism_is_served_for_a_dense_model_and_refused_elsewhere_with_why():
    one_rank = DATA_PARALLEL.replace("rank: all", "rank: 1")
    [(line, field, why)] = problems(one_rank)
    assert (line, field) == (7, "faults[0].rank")
    assert "load balancer" in why and "give rank all" in why
    offline = DATA_PARALLEL.replace("mode: serve", "mode: offline")
    [(line, field, why)] = problems(offline)
    assert (line, field) == (2, "engine.args.data_parallel_size")
    assert "data parallelism in an offline engine" in why and "engine.mode serve" in why
    moe = DATA_PARALLEL.replace("tensor_parallel_size: 1,", "model: tiny-moe, "
                                "tensor_parallel_size: 1,")
    [(line, field, why)] = problems(moe)
    assert (line, field) == (2, "engine.args.data_parallel_size")
    assert "data parallelism of an MoE model" in why and "set it to 1" in why


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


def with_sampling(sampling: str, api: str = "completions", args: str = "") -> str:
    """SERVE with random sampling (seeded) and ``sampling`` for every request."""
    text = SERVE.replace("  api: completions\n", f"  api: {api}\n  temperature: 0.5\n"
                                                  f"  seed: 1\n  sampling: {sampling}\n")
    return text.replace("mode: serve}", f"mode: serve{args}}}")


@pytest.mark.parametrize(("api", "sampling", "recorded"), [
    ("completions", "{n: 2, logprobs: 3}", (2, True, False)),
    ("completions", "{logprobs: 3, prompt_logprobs: 3}", (1, True, True)),
    ("completions", "{logprobs: 2, prompt_logprobs: 0}", (1, True, True)),
    ("completions", "{prompt_logprobs: 1}", (1, False, True)),
    ("chat", "{n: 2, logprobs: 3}", (2, True, False)),
])
def test_samples_top_logprobs_and_prompt_logprobs_are_served(api, sampling, recorded):
    """Accepted, and each request's stream records them: (samples, top-k, prompt logprobs)."""
    scenario = load_scenario_text(with_sampling(sampling, api))
    stream = serve.Stream.of(0, scenario.sampling_spec().for_request(0))
    assert (stream.samples, stream.top_k, stream.prompt) == recorded
    assert len(stream.outputs()) == stream.samples


@pytest.mark.parametrize(("api", "sampling", "args", "field", "why"), [
    # vLLM streams prompt logprobs only by echoing the prompt, counted by `logprobs`.
    ("completions", "{logprobs: 2, prompt_logprobs: 1}", "", "workload.sampling.prompt_logprobs",
     "set prompt_logprobs to 0 or 2"),
    # vLLM merges a request's completions' outputs, dropping all but the first's prompt
    # logprobs.
    ("completions", "{n: 2, logprobs: 2, prompt_logprobs: 2}", "",
     "workload.sampling.prompt_logprobs", "RequestOutput.add"),
    # The chat API streams none.
    ("chat", "{prompt_logprobs: 0}", "", "workload.sampling.prompt_logprobs",
     "chat API streams no prompt logprobs"),
    # The chat API is asked for one more top logprob than the scenario, above vLLM's 20.
    ("chat", "{logprobs: 20}", "", "workload.sampling.logprobs", "max_logprobs (20)"),
    ("chat", "{logprobs: 4}", ", args: {max_logprobs: 4}", "workload.sampling.logprobs",
     "max_logprobs (4)"),
])
def test_what_a_stream_cannot_carry_is_refused_with_why(api, sampling, args, field, why):
    found = [m for _, f, m in problems(with_sampling(sampling, api, args)) if f == field]
    assert found and f"not supported with engine.mode serve and api {api}" in found[0]
    assert why in found[0]


def test_a_larger_max_logprobs_lets_the_chat_api_ask_for_one_more():
    load_scenario_text(with_sampling("{logprobs: 20}", "chat", ", args: {max_logprobs: 21}"))


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
    assert completions["prompt"] == "hi there" and completions["logprobs"] == 0
    assert completions["stream"] is True and "echo" not in completions
    body = completions["extra_body"]
    assert body["return_tokens_as_token_ids"] is True and body["ignore_eos"] is True
    assert body["logit_bias"] == {"5": 2.0} and body["max_tokens"] == 8
    chat = serve.request_arguments("chat", "hi there", sampling)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}]
    assert chat["logprobs"] is True and "prompt" not in chat and "top_logprobs" not in chat


def test_request_arguments_ask_for_top_k_and_prompt_logprobs_as_vllm_streams_them():
    base = {"max_tokens": 8, "temperature": 0.5, "seed": 1, "n": 2}
    # Top-k and prompt logprobs alike: the echo, vLLM asking prompt_logprobs = logprobs.
    both = serve.request_arguments("completions", "hi", {**base, "logprobs": 2,
                                                         "prompt_logprobs": 2})
    assert (both["logprobs"], both["echo"]) == (2, True)
    assert both["extra_body"]["return_token_ids"] is True and both["extra_body"]["n"] == 2
    assert "prompt_logprobs" not in both["extra_body"] and "logprobs" not in both["extra_body"]
    # Prompt logprobs 0: asked explicitly (vLLM streams 0), beside the recorded top k.
    zero = serve.request_arguments("completions", "hi", {**base, "logprobs": 3,
                                                         "prompt_logprobs": 0})
    assert (zero["logprobs"], zero["echo"], zero["extra_body"]["prompt_logprobs"]) == (3, True, 0)
    # Prompt logprobs without top-k: the echo counts them by logprobs.
    prompt = serve.request_arguments("completions", "hi", {**base, "prompt_logprobs": 4})
    assert (prompt["logprobs"], prompt["echo"]) == (4, True)
    # The chat API returns one top logprob fewer than asked for.
    chat = serve.request_arguments("chat", "hi", {**base, "logprobs": 2})
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)
    assert "logprobs" not in chat["extra_body"]


def test_token_ids_are_read_from_vllms_token_id_form():
    assert serve.token_id("token_id:1234") == 1234
    with pytest.raises(Exception, match="return_tokens_as_token_ids"):
        serve.token_id("hello")


# --- streamed chunks, as vLLM's OpenAI server sends them ------------------------------------

def completion_chunk(index, tokens, *, finish=None, prompt_ids=None, text="", stop=None):
    """A completions stream chunk of choice ``index`` as ``openai`` builds it from vLLM's
    JSON (completion/serving.py: ``tokens`` are ``(id, logprob, {id: logprob})``, the top-k
    in vLLM's order; with ``prompt_ids`` the echo: the prompt's positions first)."""
    from openai.types import Completion

    def name(token):
        return f"token_id:{token}"

    choice = {"index": index, "text": text, "finish_reason": finish, "stop_reason": stop,
              "logprobs": {
        "text_offset": list(range(len(tokens))),
        "tokens": [name(t) for t, _, _ in tokens],
        "token_logprobs": [lp for _, lp, _ in tokens],
        "top_logprobs": [None if top is None else {name(t): v for t, v in top.items()}
                         for _, _, top in tokens]}}
    if prompt_ids is not None:
        choice.update(prompt_token_ids=prompt_ids, token_ids=[t for t, _, _ in tokens
                                                               ][len(prompt_ids):])
    # ``construct``: the client builds stream chunks unvalidated (vLLM's finish_reason null).
    return Completion.construct(id="cmpl-1", object="text_completion", created=1, model="m",
                                choices=[choice])


def chat_chunk(index, tokens, *, finish=None, role=None, text="", stop=None):
    from openai.types.chat import ChatCompletionChunk

    def entry(token, logprob):
        return {"token": f"token_id:{token}", "logprob": logprob, "bytes": []}

    content = [{**entry(t, lp), "top_logprobs": [entry(*p) for p in top.items()]}
               for t, lp, top in tokens]
    choice = {"index": index, "delta": {"role": role, "content": text},
              "finish_reason": finish, "stop_reason": stop,
              "logprobs": None if role else {"content": content}}
    return ChatCompletionChunk.construct(id="chatcmpl-1", object="chat.completion.chunk",
                                         created=1, model="m", choices=[choice])


#: A prompt of three tokens, with top-2 prompt logprobs (the first position has none; the
#: prompt token first, then by rank: 12 is rank 2, so three entries).
PROMPT = [(11, None, None), (12, -1.5, {12: -1.5, 40: -0.5, 41: -1.25}),
          (13, -0.75, {13: -0.75, 42: -1.0})]


def n2_top2_prompt2_chunks():
    """n 2, logprobs 2, prompt_logprobs 2: each choice's echo, then interleaved tokens, the
    last with its finish reason, then vLLM's usage chunk (no choices)."""
    from openai.types import Completion

    return [
        completion_chunk(1, [*PROMPT, (31, -0.5, {31: -0.5, 30: -1.0})], prompt_ids=[11, 12, 13]),
        completion_chunk(0, [*PROMPT, (21, -0.25, {21: -0.25, 22: -2.0})],
                         prompt_ids=[11, 12, 13]),
        completion_chunk(0, [(23, -3.0, {23: -3.0, 24: -0.125, 25: -0.5})]),
        completion_chunk(1, [(32, -0.0625, {32: -0.0625, 33: -4.0})], finish="length"),
        completion_chunk(0, [(26, -1.0, {26: -1.0, 27: -2.5})], finish="length"),
        Completion.construct(id="cmpl-1", object="text_completion", created=1, model="m",
                             choices=[]),
    ]


def test_the_text_and_stop_reason_the_client_got_go_to_the_oracle():
    """Issue 39: the serve oracle compared token ids, logprobs and finish reasons only; the
    text (which a resume rebuilds) and vLLM's stop_reason are what a client reads too."""
    chunks = [completion_chunk(0, [(21, -0.5, None)], text="Hel"),
              completion_chunk(0, [(22, -0.25, None)], text="lo", finish="stop", stop="lo")]
    [output] = read("completions", chunks, {}).outputs()
    assert (output.text, output.stop_reason, output.finish_reason) == ("Hello", "lo", "stop")
    chats = [chat_chunk(0, [(21, -0.5, {})], text="Hi"),
             chat_chunk(0, [(2, -0.25, {})], text=" there", finish="stop", stop=2)]
    [chat] = read("chat", chats, {}).outputs()
    assert (chat.text, chat.stop_reason) == ("Hi there", 2)
    # Unfinished (the stream broke): no text to compare, as offline.
    [cut] = read("completions", chunks[:1], {}).outputs()
    assert cut.text is None


def read(api, chunks, sampling):
    stream = serve.Stream.of(3, sampling)
    stream.sent_at = 0.0
    for now, chunk in enumerate(chunks, start=1):
        serve._read_chunk(api, chunk, stream, float(now))
    return stream


TOP2 = {"n": 2, "logprobs": 2, "prompt_logprobs": 2}


def test_a_streams_interleaved_choices_are_its_samples_with_top_k_and_prompt_logprobs():
    stream = read("completions", n2_top2_prompt2_chunks(), TOP2)
    assert stream.missing() is None
    first, second = stream.outputs()
    assert [(o.index, o.sample) for o in (first, second)] == [(3, 0), (3, 1)]
    assert (first.token_ids, second.token_ids) == ([21, 23, 26], [31, 32])
    assert (first.logprobs, second.logprobs) == ([-0.25, -3.0, -1.0], [-0.5, -0.0625])
    assert first.token_times == [2.0, 3.0, 5.0] and second.token_times == [1.0, 4.0]
    assert (first.finish_reason, second.finish_reason) == ("length", "length")
    # The top-k as offline records it: [token id, logprob], vLLM's order, the sampled token
    # first (token 23 is outside the top 2: three entries).
    assert first.top_logprobs == [[[21, -0.25], [22, -2.0]],
                                  [[23, -3.0], [24, -0.125], [25, -0.5]],
                                  [[26, -1.0], [27, -2.5]]]
    assert second.top_logprobs == [[[31, -0.5], [30, -1.0]], [[32, -0.0625], [33, -4.0]]]
    expected_prompt = [None, [[12, -1.5], [40, -0.5], [41, -1.25]], [[13, -0.75], [42, -1.0]]]
    assert first.prompt_logprobs == expected_prompt == second.prompt_logprobs
    # The client's view: the first token of any choice; the largest gap within one choice.
    view = stream.view()
    assert (view.tokens, view.ttft_s, view.max_gap_s) == (5, 1.0, 3.0)


def test_a_stream_without_top_k_or_prompt_logprobs_records_none():
    stream = read("completions", n2_top2_prompt2_chunks(), {"n": 2})
    first, _ = stream.outputs()
    assert first.token_ids == [21, 23, 26]  # the echo's prompt positions are not tokens
    assert first.top_logprobs is None and first.prompt_logprobs is None


def test_a_stream_that_lacks_the_prompt_logprobs_it_asked_for_says_so():
    chunks = [c for c in n2_top2_prompt2_chunks() if c.choices and
              getattr(c.choices[0], "prompt_token_ids", None) is None]
    stream = read("completions", chunks, TOP2)
    assert stream.missing() == "the server sent no prompt logprobs for choice 0"
    with pytest.raises(Exception, match="choice 2 of a request with n = 2"):
        serve._read_chunk("completions", completion_chunk(2, [(1, -1.0, {1: -1.0})]),
                          stream, 9.0)


def test_chat_chunks_are_read_per_choice_with_their_top_logprobs():
    chunks = [chat_chunk(0, [], role="assistant"), chat_chunk(1, [], role="assistant"),
              chat_chunk(1, [(7, -0.5, {7: -0.5, 8: -1.0, 9: -2.0})]),
              chat_chunk(0, [(5, -0.25, {5: -0.25, 6: -3.0, 4: -3.5})], finish="length"),
              chat_chunk(1, [(8, -1.0, {7: -0.5, 8: -1.0, 10: -2.0})], finish="length")]
    stream = read("chat", chunks, {"n": 2, "logprobs": 2})
    first, second = stream.outputs()
    assert (first.token_ids, second.token_ids) == ([5], [7, 8])
    assert first.top_logprobs == [[[5, -0.25], [6, -3.0], [4, -3.5]]]
    assert second.top_logprobs[1] == [[7, -0.5], [8, -1.0], [10, -2.0]]
    assert (first.finish_reason, first.prompt_logprobs) == ("length", None)


def run_of(stream):
    from ftkit.results import RunOutput

    return RunOutput(requests=stream.outputs())


@pytest.mark.parametrize(("where", "field"), [("top", "top_logprobs"),
                                              ("prompt", "prompt_logprobs")])
def test_a_changed_top_k_or_prompt_logprob_fails_the_serve_scenario(where, field):
    """The crippled variant: one logprob of one top-k (or prompt) entry of sample 1, one ulp
    off, makes the verdict fail at that field; unchanged, it passes."""
    import math

    from ftkit.verify import verify

    # (The scenario decides the verdict's rules; the outputs are the parsed chunks'.)
    scenario = load_scenario_text(with_sampling("{n: 2, logprobs: 2}")
                                  .replace("faults:\n  - {kind: link_flap, rank: 1, at: "
                                           "{request: 1, token: 3}, times: 2}\n",
                                           "faults: []\n"))
    baseline = run_of(read("completions", n2_top2_prompt2_chunks(), TOP2))
    same = run_of(read("completions", n2_top2_prompt2_chunks(), TOP2))
    assert verify(scenario, baseline, same, file="s.yaml", duration_s=1.0).verdict == Verdict.PASS
    crippled = run_of(read("completions", n2_top2_prompt2_chunks(), TOP2))
    sample1 = crippled.requests[1]
    entry = sample1.top_logprobs[1][1] if where == "top" else sample1.prompt_logprobs[2][1]
    entry[1] = math.nextafter(entry[1], 0.0)
    result = verify(scenario, baseline, crippled, file="s.yaml", duration_s=1.0)
    assert result.verdict == Verdict.FAIL
    mismatch = result.first_mismatch
    assert (mismatch.index, mismatch.sample, mismatch.diverged_field) == (3, 1, field)


def test_a_streams_view_has_its_time_to_first_token_and_largest_gap():
    stream = serve.Stream(request=1, sent_at=0.5)
    stream.completions[0].token_ids[:] = [1, 2, 3, 4]
    stream.completions[0].token_times[:] = [1.0, 1.25, 3.0, 3.5]
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
