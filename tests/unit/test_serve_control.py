"""Injection into a live server, below HTTP: the route's checks (settings, secret, the fault
itself) against a stand-in engine client that records every call, so that "refused" is shown
to mean "the engine was never asked"; the injector's live targets (a client's request id, a
number of steps ahead); and the client's errors. The real server: tests/serve."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from ftkit.config import INJECT_SECRET_ENV
from ftkit.contracts.plan import FaultPlan, PlannedFault
from ftkit.contracts.requests import (ServedRequestRef, parse_served_request_id, request_id,
                                     resumed_offset, served_request_matches)
from ftkit.contracts.step import RpcKind
from ftkit.errors import FtkitError, InjectionError
from ftkit.scenario.model import FaultSpec
from ftkit.serve import control
from ftkit.serve.client import InjectRefused, inject_live_fault
from ftkit.serve.control import BadFault, Control, EngineUnavailable, Refused, live_fault
from test_inject import fired, injector  # the injector tests' stand-ins

SECRET = "0123456789abcdef-secret"
ON = {"fault_tolerance": {"enabled": True, "injection": True}}


class Engine:
    """A stand-in ``EngineClient``: records ``collective_rpc`` calls; each rank answers what
    ``answers`` says (``None``: planned)."""

    def __init__(self, world_size=2, errors=None, delay_s=0.0, plan_delays_s=()):
        self.calls = []
        self.errors = errors or {}
        self.delay_s = delay_s
        #: The delays of the first plan calls (later ones: ``delay_s``).
        self.plan_delays_s = list(plan_delays_s)
        self.vllm_config = vllm_config(world_size)
        self.world_size = world_size
        #: The plans every rank holds (those of calls that were not only checks).
        self.planned = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        plan, check_only, _secret = args
        late = self.plan_delays_s.pop(0) if self.plan_delays_s and not check_only else None
        await asyncio.sleep(self.delay_s if late is None else late)
        if not check_only and not self.errors:
            self.planned += [f.index for f in FaultPlan.from_json(plan).faults]
        return [{"rank": r, "error": self.errors.get(r)} for r in range(self.world_size)]


def vllm_config(tp=2, pp=1, dp=1, max_model_len=512):
    """The parts of a server's ``VllmConfig`` the route reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        data_parallel_size=dp, world_size=tp * pp,
                                        distributed_executor_backend="mp"),
        model_config=SimpleNamespace(max_model_len=max_model_len))


def engine(tp=2, **kwargs):
    return control.served_engine(vllm_config(tp, **kwargs))


def control_of(additional=ON, engine=None, secret=SECRET):
    environ = {} if secret is None else {control.SECRET_ENV: secret}
    return Control.of_server(engine if engine is not None else Engine(), additional, environ)


def run(coro):
    return asyncio.run(coro)


FAULT = {"kind": "link_break", "rank": 1, "request_id": "client-7", "token": 4}


# --- the server's settings, at start ---------------------------------------------------------

@pytest.mark.parametrize(("additional", "secret", "message"), [
    (ON, None, "FTKIT_INJECT_SECRET is unset"),
    (ON, "short", "FTKIT_INJECT_SECRET is too short"),
    ({"fault_tolerance": {"injection": True}}, SECRET, "injection needs fault_tolerance.enabled"),
    ({"fault_tolerance": {"enabled": True, "injektion": True}}, SECRET, "unknown key"),
])
def test_a_server_that_cannot_take_faults_safely_does_not_start(additional, secret, message):
    with pytest.raises(FtkitError, match=message):
        control_of(additional, secret=secret)


# --- refusals change nothing -----------------------------------------------------------------

@pytest.mark.parametrize(("additional", "presented", "message"), [
    (None, SECRET, "runs without ftkit's fault_tolerance settings"),
    ({"fault_tolerance": {"enabled": True}}, SECRET, 'do not say "injection": true'),
    (ON, None, "wrong or missing secret"),
    (ON, SECRET[:-1] + "X", "wrong or missing secret"),
])
def test_a_refused_injection_never_reaches_the_engine(additional, presented, message):
    engine = Engine()
    ctl = control_of(additional, engine)
    with pytest.raises(Refused, match=message):
        run(ctl.inject(FAULT, presented))
    assert engine.calls == [] and ctl.planned == 0


def test_an_accepted_fault_is_checked_on_every_rank_then_planned():
    engine = Engine()
    ctl = control_of(engine=engine)
    answer = run(ctl.inject(FAULT, SECRET))
    assert answer == {"planned": {"index": 0, "kind": "link_break", "rank": 1,
                                  "phase": "forward", "times": 1, "params": {},
                                  "request_id": "client-7", "token": 4}}
    assert [(m, check) for m, (_, check, _) in engine.calls] == [
        (control.RPC_METHOD, True), (control.RPC_METHOD, False)]
    plan = FaultPlan.from_json(engine.calls[1][1][0])
    assert plan.run_id is None
    [fault] = plan.faults
    assert (fault.request_key, fault.after_steps, fault.spec.at.token) == ("client-7", None, 4)
    run(ctl.inject({**FAULT, "request_id": None, "token": None, "after_steps": 2}, SECRET))
    assert ctl.planned == 2
    assert FaultPlan.from_json(engine.calls[3][1][0]).faults[0].index == 1


def test_a_fault_one_rank_cannot_inject_is_planned_on_none():
    engine = Engine(errors={1: "uce cannot be injected here"})
    ctl = control_of(engine=engine)
    with pytest.raises(BadFault, match="rank 1: uce cannot be injected here"):
        run(ctl.inject(FAULT, SECRET))
    assert [check for _, (_, check, _) in engine.calls] == [True]  # no second call
    assert ctl.planned == 0


def test_an_engine_that_does_not_answer_is_unavailable(monkeypatch):
    monkeypatch.setattr(control, "RPC_TIMEOUT_S", 0.05)
    ctl = control_of(engine=Engine(delay_s=1.0))
    with pytest.raises(EngineUnavailable, match="nothing was planned, try again"):
        run(ctl.inject(FAULT, SECRET))
    assert ctl.planned == 0


@pytest.mark.parametrize(("body", "message"), [
    ([], "must be a JSON object"),
    ({**FAULT, "tokne": 3}, "unknown field"),
    ({"kind": "hang", "rank": 0}, "either request_id"),
    ({**FAULT, "after_steps": 1}, "either request_id"),
    ({**FAULT, "token": None}, "request_id needs token"),
    ({"kind": "hang", "rank": 0, "after_steps": 1, "token": 2}, "token goes with request_id"),
    ({"kind": "hang", "rank": 0, "after_steps": -1}, "after_steps must be an integer >= 0"),
    ({**FAULT, "request_id": ""}, "non-empty string"),
    ({**FAULT, "kind": "meteor"}, "kind"),
    ({**FAULT, "rank": 2}, "rank: 2 is not a rank of this server"),
    ({**FAULT, "times": 0}, "times"),
    ({**FAULT, "phase": "later"}, "phase"),
    ({**FAULT, "kind": "hang", "params": {"op_timeout": 1}}, "op_timeout"),
    ({"kind": "uce", "rank": 0, "after_steps": 0}, "request_id and token"),
])
def test_a_bad_fault_is_refused_naming_the_field(body, message):
    with pytest.raises(BadFault, match=message):
        live_fault(body, 0, engine(2))


@pytest.mark.parametrize(("body", "tp", "message"), [
    # The kinds' own rules, as ftkit validate runs them on a scenario (issue 39's review:
    # each was accepted, and failed at fire time or did nothing).
    ({"kind": "uce", "rank": 0, "phase": "before", "request_id": "c", "token": 0,
      "params": {"region": "kv"}}, 1, "token: before its prefill a request holds no KV"),
    ({"kind": "process_kill", "rank": 0, "times": 3, "after_steps": 1}, 1,
     "times: a killed process fails no further attempt"),
    ({"kind": "link_break", "rank": 0, "after_steps": 1}, 1, "kind: link faults need a peer"),
    ({"kind": "link_flap", "rank": 0, "after_steps": 1}, 2, "times: a flap repeats"),
    ({"kind": "node_loss", "rank": 0, "after_steps": 1}, 2, "needs vLLM's Ray executor"),
    # A token the server never computes.
    ({**FAULT, "token": 512}, 2, "token: token 512 is never computed: the server's "
                                 "max_model_len is 512"),
    ({**FAULT, "id": ""}, 2, "id must be a non-empty string"),
])
def test_a_live_fault_follows_the_rules_of_a_scenarios_fault(body, tp, message):
    with pytest.raises(BadFault, match=message):
        live_fault(body, 0, engine(tp))


def test_the_rules_see_the_servers_own_engine():
    """Pipeline stages, replicas and the length come from the server's configuration: a
    sampling fault on a stage that does not sample is refused, a rank of the second replica
    is a rank of the server."""
    two_stages = engine(1, pp=2)
    with pytest.raises(BadFault, match="phase: rank 0 is on pipeline stage 0 of 2"):
        live_fault({**FAULT, "kind": "oom", "rank": 0, "phase": "sample"}, 0, two_stages)
    live_fault({**FAULT, "kind": "oom", "rank": 1, "phase": "sample"}, 0, two_stages)
    replicas = engine(1, dp=2)
    assert live_fault({**FAULT, "kind": "oom", "rank": 1}, 0, replicas).spec.rank == 1
    with pytest.raises(BadFault, match="rank: 2 is not a rank of this server .it has 2"):
        live_fault({**FAULT, "kind": "oom", "rank": 2}, 0, replicas)
    assert engine(1, max_model_len=4096).max_model_len == 4096


def test_a_rule_broken_through_the_route_never_reaches_the_engine():
    eng = Engine(world_size=1)
    ctl = control_of(engine=eng)
    with pytest.raises(BadFault, match="link faults need a peer"):
        run(ctl.inject({**FAULT, "rank": 0}, SECRET))
    assert eng.calls == [] and ctl.planned == 0


# --- a plan call answered late, and repeated ---------------------------------------------------

def test_a_plan_the_engine_answers_late_keeps_its_index_and_is_never_planned_twice(
        monkeypatch):
    """The engine checks the fault in time but takes it after the route stopped waiting (a
    long recovery): the client hears that it may still be planned; its index is spent, and
    the same call repeated with its id answers the outcome and plans nothing more. (The route
    before this said "nothing was planned, try again" and gave the retry the same index: the
    engine then held the fault twice, both numbered 0.)"""
    monkeypatch.setattr(control, "RPC_TIMEOUT_S", 0.2)
    eng = Engine(plan_delays_s=[0.35])
    ctl = control_of(engine=eng)
    call = {**FAULT, "id": "plan-1"}

    async def scenario():
        with pytest.raises(EngineUnavailable, match="may still be planned; send the same call "
                                                    "again .same id."):
            await ctl.inject(call, SECRET)
        assert ctl.planned == 1  # the index is spent
        again = await ctl.inject(call, SECRET)  # waits for the first call's outcome
        assert again["repeated"] is True and again["planned"]["index"] == 0
        assert again["planned"]["id"] == "plan-1"
        later = await ctl.inject({**FAULT, "id": "plan-2"}, SECRET)
        assert later["planned"]["index"] == 1 and "repeated" not in later
        with pytest.raises(BadFault, match="id 'plan-1' named another fault"):
            await ctl.inject({**call, "token": 9}, SECRET)

    run(scenario())
    assert eng.planned == [0, 1]  # each fault once, on its own index
    assert [f.index for f in ctl.faults] == [0, 1]


def test_a_plan_without_an_id_answered_late_is_reported_as_possibly_planned(monkeypatch):
    monkeypatch.setattr(control, "RPC_TIMEOUT_S", 0.1)
    eng = Engine(plan_delays_s=[0.3])
    ctl = control_of(engine=eng)

    async def scenario():
        with pytest.raises(EngineUnavailable, match="may still be planned; a call with an id "
                                                    "can be repeated safely"):
            await ctl.inject(FAULT, SECRET)
        await asyncio.sleep(0.3)  # the late answer comes
        assert [f.index for f in ctl.faults] == [0]
        answer = await ctl.inject(FAULT, SECRET)  # a second fault, on an index of its own
        assert answer["planned"]["index"] == 1

    run(scenario())
    assert eng.planned == [0, 1]


# --- the workers' own check of the secret ----------------------------------------------------

def test_the_route_passes_the_secret_on_to_the_workers():
    eng = Engine()
    run(control_of(engine=eng).inject(FAULT, SECRET))
    assert [args[2] for _, args in eng.calls] == [SECRET, SECRET]


@pytest.mark.parametrize(("environ", "presented", "refused"), [
    ({INJECT_SECRET_ENV: SECRET}, None, True),  # vLLM's /collective_rpc, in dev mode
    ({INJECT_SECRET_ENV: SECRET}, SECRET[:-1] + "X", True),
    ({INJECT_SECRET_ENV: SECRET}, SECRET, False),
    ({}, None, False),  # an offline engine of ftkit's own: no secret, nothing to check
])
def test_a_worker_with_a_secret_plans_nothing_without_it(environ, presented, refused):
    from ftkit.vllm.worker import secret_problem

    problem = secret_problem(presented, environ)
    assert (problem is not None) is refused
    if refused:
        assert "without this server's secret" in problem


# --- the HTTP route --------------------------------------------------------------------------

@pytest.fixture
def route():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ftkit.serve import routes

    app = FastAPI()
    app.include_router(routes.router())
    eng = Engine()
    app.state.ftkit_control = control_of(engine=eng)
    with TestClient(app) as client:
        yield client, eng


def test_the_route_checks_the_secret_before_it_reads_the_body(route, monkeypatch):
    from ftkit.serve import routes

    client, eng = route
    read = []
    original = routes._read_body

    async def spy(request):
        read.append(request)
        return await original(request)

    monkeypatch.setattr(routes, "_read_body", spy)
    huge = b"[" + b"0," * (control.MAX_BODY_BYTES) + b"0]"
    answer = client.post(control.INJECT_PATH, content=huge, headers={"X-Ftkit-Secret": "no"})
    assert answer.status_code == 403 and read == []  # refused unread
    answer = client.post(control.INJECT_PATH, content=huge,
                         headers={"X-Ftkit-Secret": SECRET})
    assert answer.status_code == 413 and "larger than" in answer.json()["error"]
    answer = client.post(control.INJECT_PATH, json={**FAULT, "rank": 5},
                         headers={"X-Ftkit-Secret": SECRET})
    assert answer.status_code == 422 and "rank: 5" in answer.json()["error"]
    assert eng.calls == []
    answer = client.post(control.INJECT_PATH, json=FAULT, headers={"X-Ftkit-Secret": SECRET})
    assert answer.status_code == 200 and answer.json()["planned"]["index"] == 0


def test_a_uce_outside_the_kv_cache_may_be_planned_steps_ahead():
    fault = live_fault({"kind": "uce", "rank": 0, "after_steps": 0,
                        "params": {"region": "weights"}}, 3, engine(1))
    assert (fault.index, fault.after_steps, fault.live) == (3, 0, True)


# --- the ids a server gives a client's request -----------------------------------------------

@pytest.mark.parametrize(("engine_id", "client_id", "matches"), [
    ("cmpl-client-7-0-1a2b3c4d", "client-7", True),
    ("chatcmpl-client-7-1a2b3c4d", "client-7", True),
    ("1_cmpl-client-7-0-1a2b3c4d", "client-7", True),  # a completion of n > 1
    ("cmpl-client-70-0-1a2b3c4d", "client-7", False),
    ("cmpl-other-client-7-0-1a2b3c4d", "client-7", False),
    ("ftkit:r1:0-1a2b3c4d", "r1", False),
    ("client-7-0", "client-7", False),
    # Resumed by a restarted engine: chat and completions alike, any completion.
    ("chatcmpl-client-7+ftkit4-0a1b2c3d", "client-7", True),
    ("cmpl-client-7-0+ftkit4-0a1b2c3d", "client-7", True),
    ("2_cmpl-client-7-0+ftkit4-0a1b2c3d", "client-7", True),
    # Exactly the id named: not another id it is a prefix of, chat or completions.
    ("cmpl-user-2-0-0a1b2c3d", "user", False),
    ("chatcmpl-user-2-0a1b2c3d", "user", False),
    ("chatcmpl-user-2+ftkit3-0a1b2c3d", "user", False),
    ("cmpl-user-0-0a1b2c3d", "user", True),
])
def test_a_clients_request_is_known_by_the_id_the_server_gives_it(engine_id, client_id,
                                                                   matches):
    assert served_request_matches(engine_id, client_id) is matches


@pytest.mark.parametrize(("engine_id", "ref"), [
    ("cmpl-a-b-3-0a1b2c3d", ServedRequestRef("completions", "a-b", prompt=3)),
    ("1_chatcmpl-a_b+ftkit12-0a1b2c3d", ServedRequestRef("chat", "a_b", sample=1, offset=12)),
    ("chatcmpl-a+ftkit3+ftkit5-0a1b2c3d", ServedRequestRef("chat", "a+ftkit3", offset=5)),
    ("cmpl-a-0", None),  # no engine suffix: not an engine's id
    ("resp-a-0a1b2c3d", None),  # an API whose ids ftkit does not read
])
def test_one_parser_reads_every_served_id(engine_id, ref):
    assert parse_served_request_id(engine_id) == ref
    assert resumed_offset(engine_id) == (ref.offset if ref else 0)


def test_served_ids_without_the_engines_suffix_when_vllm_is_told_so():
    off = {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
    # With randomization off, what looks like a suffix belongs to the client's id.
    assert parse_served_request_id("chatcmpl-user-deadbeef", off) == \
        ServedRequestRef("chat", "user-deadbeef")
    assert parse_served_request_id("cmpl-user-0", off) == ServedRequestRef("completions", "user")
    assert parse_served_request_id("cmpl-user-0-0a1b2c3d", off) is None  # no prompt index


# --- the injector's live faults --------------------------------------------------------------

def live_plan(index=0, *, kind="oom", rank=0, key=None, token=0, after=None, **params):
    spec = live_fault({"kind": kind, "rank": rank, "params": params,
                       **({"request_id": key, "token": token} if key else
                          {"after_steps": after})}, index, engine(2)).spec
    return FaultPlan(None, (PlannedFault(index, spec, request_key=key, after_steps=after),))


def step(inj, n, ids):
    inj.on_attempt(RpcKind.EXECUTE, n, 0, ids)


def test_a_live_fault_for_a_client_request_fires_at_its_token_and_keeps_the_others():
    inj = injector()
    inj.add_live(live_plan(0, key="c-1", token=3))
    inj.add_live(live_plan(1, after=100))
    step(inj, 1, {"cmpl-c-1-0-abcd0123": 2, "cmpl-c-2-0-abcd0123": 3})
    assert fired(inj) == []
    with pytest.raises(Exception, match="out of memory"):
        step(inj, 2, {"cmpl-c-1-0-abcd0123": 3})
        inj.forward_hook()
    assert [(e.index, e.step) for e in fired(inj)] == [(0, 2)]
    assert [f.planned.index for f in inj.faults] == [0, 1]  # the steps-ahead one still waits


def test_a_live_fault_on_a_resumed_request_counts_the_tokens_it_had():
    """A request the restarted server resumed after 12 tokens: its engine id says so, and its
    token 3 there is the client's token 15 (crippled: counted from the resume, the fault
    planned for token 15 would fire 12 tokens late)."""
    inj = injector()
    inj.add_live(live_plan(0, key="c-1", token=15))
    step(inj, 1, {"cmpl-c-1-0+ftkit12-ef012345": 2})
    assert fired(inj) == []
    with pytest.raises(Exception, match="out of memory"):
        step(inj, 2, {"cmpl-c-1-0+ftkit12-ef012345": 3})
        inj.forward_hook()
    assert [(e.index, e.step) for e in fired(inj)] == [(0, 2)]


def test_a_new_engine_is_given_the_live_faults_still_to_fire():
    """After an engine replacement (``RestartingEngine.on_replaced``), the new engine gets
    every fault planned for a request that has not failed all its attempts, with those it
    did (the ranks' published records); a fault planned by steps of the dead engine is
    dropped. Crippled: without ``replan`` the new engine is asked nothing."""
    from ftkit.serve.state import RankRecord

    old, new = Engine(), Engine()
    ctl = control_of(engine=old)
    for body in (FAULT,  # 0: fired (the kill, say): not again
                 {**FAULT, "kind": "link_flap", "times": 3},  # 1: fired once of three
                 {**FAULT, "token": 30},  # 2: never fired
                 {**FAULT, "request_id": None, "token": None, "after_steps": 50}):  # 3
        run(ctl.inject(body, SECRET))
    records = {0: RankRecord(rank=0, fired={"0": 1, "1": 1}), 1: RankRecord(rank=1)}
    ctl.read_ranks = lambda: records
    run(ctl.replan(new))
    [(method, (plan_json, check_only, secret))] = new.calls
    assert (method, check_only, secret) == (control.RPC_METHOD, False, SECRET)
    plan = FaultPlan.from_json(plan_json)
    assert [(f.index, f.fired, f.request_key) for f in plan.faults] == [
        (1, 1, "client-7"), (2, 0, "client-7")]
    assert len(old.calls) == 8  # its two calls per fault, no more
    # Every fault fired all its attempts: nothing to ask.
    records[1] = RankRecord(rank=1, fired={"1": 3, "2": 1})
    quiet = Engine()
    run(ctl.replan(quiet))
    assert quiet.calls == []


def test_a_fault_planned_by_steps_is_dropped_once(caplog):
    """A fault planned by steps of a dead engine (its attempts left) is dropped, and said so,
    at the first replacement only: a later one has nothing of it to say (crippled: kept, it
    was logged as dropped again at every replacement)."""
    import logging

    from ftkit.serve.state import RankRecord

    ctl = control_of(engine=Engine())
    run(ctl.inject({**FAULT, "request_id": None, "token": None, "after_steps": 50,
                    "times": 2}, SECRET))
    ctl.read_ranks = lambda: {0: RankRecord(rank=0, fired={"0": 1})}  # one of its two fired
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        run(ctl.replan(Engine()))
        run(ctl.replan(Engine()))
    dropped = [r for r in caplog.records if "planned by steps of the dead engine" in r.message]
    assert len(dropped) == 1 and "[0]" in dropped[0].getMessage()
    assert ctl.faults == []


def test_a_live_fault_steps_ahead_fires_in_the_step_it_names():
    inj = injector()
    inj.add_live(live_plan(0, after=2))
    for n in (10, 11):
        step(inj, n, {})
    assert fired(inj) == []
    with pytest.raises(Exception, match="out of memory"):
        step(inj, 12, {})
        inj.forward_hook()
    assert [e.step for e in fired(inj)] == [12]


def test_checking_a_live_fault_plans_nothing_and_a_plain_plan_is_no_live_fault():
    inj = injector()
    inj.add_live(live_plan(0, after=0), check_only=True)
    assert inj.faults == []
    with pytest.raises(InjectionError, match="names no client request"):
        inj.add_live(FaultPlan.from_specs(None, [live_plan(0, after=0).faults[0].spec]))
    with pytest.raises(InjectionError, match="process_kill cannot be injected here"):
        inj.add_live(live_plan(0, kind="process_kill", after=0))
    assert inj.faults == []


def test_a_live_plan_survives_its_json_journey():
    plan = live_plan(4, key="c-9", token=5)
    assert FaultPlan.from_json(plan.to_json()) == plan


# --- the client ------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    status = 200
    body = b"{}"
    location = None
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        type(self).seen.append((self.path, dict(self.headers), json.loads(self.rfile.read(length))))
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.seen = []
    yield server, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(5)


ANSWER = {"planned": {"index": 0, "kind": "link_break", "rank": 1, "phase": "forward",
                      "times": 1, "params": {}, "request_id": "client-7", "token": 4}}


def test_the_client_sends_the_secret_and_returns_the_answer(http_server):
    _, url = http_server
    _Handler.status, _Handler.body = 200, json.dumps(ANSWER).encode()
    assert inject_live_fault(url, FAULT, SECRET) == ANSWER
    [(path, headers, body)] = _Handler.seen
    assert path == control.INJECT_PATH and body == FAULT
    assert headers[control.SECRET_HEADER] == SECRET


@pytest.mark.parametrize(("status", "body", "message"), [
    (403, b'{"error": "wrong or missing secret"}', "wrong or missing secret"),
    (404, b'{"detail": "Not Found"}', "does not load ftkit's endpoint plugin"),
    (400, b'{"message": "bad body"}', "bad body"),
])
def test_the_client_reports_a_refusal_with_the_servers_reason(http_server, status, body,
                                                              message):
    _, url = http_server
    _Handler.status, _Handler.body = status, body
    with pytest.raises(InjectRefused, match=message) as refused:
        inject_live_fault(url, FAULT, None)
    assert refused.value.status == status
    assert control.SECRET_HEADER not in _Handler.seen[0][1]


def test_the_client_never_follows_a_redirect(http_server):
    """A redirect to another host would carry the secret along (urllib follows 307 with the
    same headers): the client stops at it and the other host hears nothing."""
    other = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        _, url = http_server
        _Handler.status, _Handler.body = 307, b"{}"
        _Handler.location = f"http://127.0.0.1:{other.server_port}{control.INJECT_PATH}"
        with pytest.raises(FtkitError, match="HTTP 307, a redirect to .*does not follow"):
            inject_live_fault(url, FAULT, SECRET)
        assert len(_Handler.seen) == 1  # the first server only
    finally:
        _Handler.location = None
        other.shutdown()
        thread.join(5)


@pytest.mark.parametrize("body", [
    b'{}', b'{"planned": null}', b'{"planned": {"index": "0", "kind": "oom"}}',
    b'{"planned": {"index": 0, "kind": "oom", "rank": 0, "phase": "forward", "times": 1}}',
    b'[1, 2]',
])
def test_the_client_refuses_an_answer_no_ftkit_server_gives(http_server, body):
    _, url = http_server
    _Handler.status, _Handler.body = 200, body
    with pytest.raises(FtkitError, match="bad answer from"):
        inject_live_fault(url, FAULT, SECRET)


def test_the_client_reports_an_unreachable_server():
    with pytest.raises(FtkitError, match="cannot reach http://127.0.0.1:9"):
        inject_live_fault("http://127.0.0.1:9", FAULT, None, timeout_s=5)
    with pytest.raises(FtkitError, match="must start with http"):
        inject_live_fault("127.0.0.1:9", FAULT, None)


# --- settings that mean nothing without recovery ----------------------------------------------

@pytest.mark.parametrize(("settings", "message"), [
    ({"enabled": False, "max_restarts": 3, "standby": True},
     "fault_tolerance.max_restarts and fault_tolerance.standby need fault_tolerance.enabled: "
     "true"),
    ({"enabled": False, "max_restarts": 1}, "fault_tolerance.max_restarts needs "),
    ({"enabled": False, "injection": True}, "fault_tolerance.injection needs "),
])
def test_restart_standby_and_injection_settings_are_refused_with_recovery_off(settings,
                                                                             message):
    from ftkit.config import RecoveryConfig

    with pytest.raises(FtkitError, match=message):
        RecoveryConfig.from_mapping(settings)
    RecoveryConfig.from_mapping({**settings, "enabled": True, "injection": False})


# --- a live fault that cannot act where it fires ----------------------------------------------

def test_a_live_fault_that_cannot_act_is_skipped_and_the_step_runs_on():
    """A KV UCE planned for a request whose blocks the runner does not hold (the stand-in
    memory holds none of a served request's) fires and cannot act: the injector says so in a
    log line and an event, leaves no attempt of it, and the step goes on; the engine does not
    end (issue 39: such a fault ended the engine and the server exited). A scenario's own fault
    that cannot act still raises (the run reports it)."""
    from ftkit.contracts.eventlog import FaultSkipped

    inj = injector()
    inj.add_live(live_plan(0, kind="uce", key="c-1", token=3, region="kv"))
    step(inj, 1, {"cmpl-c-1-0-abcd0123": 3})  # phase forward: acts at the forward hook
    inj.forward_hook()  # no exception: skipped
    [skipped] = [e for e in inj.events.events if isinstance(e, FaultSkipped)]
    assert (skipped.index, skipped.kind, skipped.step) == (0, "uce", 1)
    assert "holds no KV block" in skipped.reason
    assert [e.index for e in fired(inj)] == [0] and inj.faults[0].fired == 1
    step(inj, 2, {"cmpl-c-1-0-abcd0123": 3})
    inj.forward_hook()
    assert len(fired(inj)) == 1  # not again

    scenario = injector()
    scenario.set_plan(FaultPlan.from_specs("run2", [FaultSpec.model_validate(
        {"kind": "uce", "rank": 0, "at": {"request": 0, "token": 3},
         "params": {"region": "kv"}})]))
    step(scenario, 1, {request_id("run2", 0) + "-abc": 3})
    with pytest.raises(InjectionError, match="holds no KV block"):
        scenario.forward_hook()
