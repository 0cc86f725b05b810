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

from ftkit.contracts.plan import FaultPlan, PlannedFault
from ftkit.contracts.requests import (ServedRequestRef, parse_served_request_id, resumed_offset,
                                     served_request_matches)
from ftkit.contracts.step import RpcKind
from ftkit.errors import FtkitError, InjectionError
from ftkit.serve import control
from ftkit.serve.client import InjectRefused, inject_live_fault
from ftkit.serve.control import BadFault, Control, EngineUnavailable, Refused, live_fault
from test_inject import fired, injector  # the injector tests' stand-ins

SECRET = "0123456789abcdef-secret"
ON = {"fault_tolerance": {"enabled": True, "injection": True}}


class Engine:
    """A stand-in ``EngineClient``: records ``collective_rpc`` calls; each rank answers what
    ``answers`` says (``None``: planned)."""

    def __init__(self, world_size=2, errors=None, delay_s=0.0):
        self.calls = []
        self.errors = errors or {}
        self.delay_s = delay_s
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(world_size=world_size))
        self.world_size = world_size

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        await asyncio.sleep(self.delay_s)
        return [{"rank": r, "error": self.errors.get(r)} for r in range(self.world_size)]


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
    assert [(m, check) for m, (_, check) in engine.calls] == [
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
    assert [check for _, (_, check) in engine.calls] == [True]  # no second call
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
    ({**FAULT, "rank": 2}, "rank: 2 is not a rank of this engine"),
    ({**FAULT, "times": 0}, "times"),
    ({**FAULT, "phase": "later"}, "phase"),
    ({**FAULT, "kind": "hang", "params": {"op_timeout": 1}}, "op_timeout"),
    ({"kind": "uce", "rank": 0, "after_steps": 0}, "request_id and token"),
])
def test_a_bad_fault_is_refused_naming_the_field(body, message):
    with pytest.raises(BadFault, match=message):
        live_fault(body, 0, world_size=2)


def test_a_uce_outside_the_kv_cache_may_be_planned_steps_ahead():
    fault = live_fault({"kind": "uce", "rank": 0, "after_steps": 0,
                        "params": {"region": "weights"}}, 3, world_size=1)
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
                          {"after_steps": after})}, index, world_size=2).spec
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
    [(method, (plan_json, check_only))] = new.calls
    assert (method, check_only) == (control.RPC_METHOD, False)
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
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        type(self).seen.append((self.path, dict(self.headers), json.loads(self.rfile.read(length))))
        self.send_response(self.status)
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


def test_the_client_sends_the_secret_and_returns_the_answer(http_server):
    _, url = http_server
    _Handler.status, _Handler.body = 200, b'{"planned": {"index": 0}}'
    assert inject_live_fault(url, FAULT, SECRET) == {"planned": {"index": 0}}
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


def test_the_client_reports_an_unreachable_server():
    with pytest.raises(FtkitError, match="cannot reach http://127.0.0.1:9"):
        inject_live_fault("http://127.0.0.1:9", FAULT, None, timeout_s=5)
    with pytest.raises(FtkitError, match="must start with http"):
        inject_live_fault("127.0.0.1:9", FAULT, None)
