"""ftkit's routes in a running vLLM server: ``POST /ftkit/inject`` plans a fault in it.

The control path. vLLM (0.32) offers *endpoint plugins* (entry point group
``vllm.endpoint_plugins``): routes a package adds to the OpenAI API server, loaded only where the
operator names the plugin in ``VLLM_PLUGINS``. ftkit registers one, ``ftkit`` (the name of its
general plugin too, so ``VLLM_PLUGINS`` either allows both or neither). Its route hands the fault
to every worker with the engine's own ``collective_rpc``, calling the one method ftkit's general
plugin adds to each worker, ``ftkit_add_live_faults``: the engine core sends it to all ranks
between two steps, so every rank sees the fault from the same step on.

Why it is safe. Nothing else is opened: not vLLM's development route (``/collective_rpc``, which
runs any worker method), no new port, no second process. Injection needs three things at once:

* the operator loaded the plugin (``VLLM_PLUGINS`` names ``ftkit``); otherwise the route does
  not exist;
* the server's settings say ``"injection": true`` inside ``fault_tolerance``; otherwise every
  attempt is refused (403) before the engine is reached, and the workers, which read the same
  settings, refuse the call as well;
* the request carries the shared secret of the server's ``FTKIT_INJECT_SECRET`` (header
  ``X-Ftkit-Secret``, compared in constant time, before the body is read); a server with
  injection on and no secret of at least 16 characters refuses to start. The route passes the
  secret on, and the workers, which inherit the variable, refuse a plan without it (one that
  reaches them through vLLM's ``/collective_rpc`` in development mode).

A refused attempt changes nothing. An accepted one is checked by every rank before any rank
keeps it (a fault one rank cannot inject is planned on none), and logged by the server and by
each rank.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from ftkit.config import CONFIG_KEY, INJECT_SECRET_ENV, RecoveryConfig
from ftkit.contracts.plan import FaultPlan, PlannedFault
from ftkit.errors import FtkitError
from ftkit.scenario.errors import format_loc
from ftkit.scenario.model import EngineSpec, FaultSpec
from ftkit.scenario.rules import fault_problems
from ftkit.serve.state import fired_attempts

log = logging.getLogger("ftkit")

#: The server's environment variable that holds the shared secret; ``ftkit inject`` reads the
#: same one, and every worker checks it too.
SECRET_ENV = INJECT_SECRET_ENV
#: The request header that carries it.
SECRET_HEADER = "X-Ftkit-Secret"
#: The shortest secret a server accepts.
MIN_SECRET_CHARS = 16
INJECT_PATH = "/ftkit/inject"
#: The worker method the route calls on every rank (``FtkitWorker.add_live_faults``).
RPC_METHOD = "ftkit_add_live_faults"
#: Bound on the engine's answer. The call waits behind the step that runs (vLLM's own bound on
#: a step is ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, raised for recovery); a step that outlasts
#: this one is in a long recovery, and the client is told to try again.
RPC_TIMEOUT_S = 60.0

#: The keys a fault's JSON may have. ``id``: the client's name for this plan call, which
#: makes it idempotent (a call repeated with the same id plans nothing more and answers what
#: the first planned).
FAULT_KEYS = ("kind", "rank", "phase", "times", "params", "request_id", "token", "after_steps",
              "id")
#: The longest body the route reads (a fault is a few hundred bytes).
MAX_BODY_BYTES = 16 * 1024
#: The longest plan id.
MAX_ID_CHARS = 128


class Refused(FtkitError):
    """An injection this server does not accept (HTTP 403): nothing was changed."""


class BadFault(FtkitError):
    """A fault that cannot be planned as given (HTTP 422): nothing was changed."""


class EngineUnavailable(FtkitError):
    """The engine did not answer (HTTP 503): nothing was planned."""


def served_engine(vllm_config: Any) -> EngineSpec:
    """The engine a server runs, as a scenario's ``engine`` section: what a live fault's
    rules (``ftkit.scenario.rules.fault_problems``, those of ``ftkit validate``) are checked
    against. ``vllm_config``: the API server's ``VllmConfig``."""
    parallel = getattr(vllm_config, "parallel_config", None)
    model = getattr(vllm_config, "model_config", None)

    def size(obj: Any, name: str) -> int:
        value = getattr(obj, name, 1)
        return value if isinstance(value, int) and value > 0 else 1

    args: dict[str, Any] = {"pipeline_parallel_size": size(parallel, "pipeline_parallel_size"),
                            "data_parallel_size": size(parallel, "data_parallel_size")}
    backend = getattr(parallel, "distributed_executor_backend", None)
    if isinstance(backend, str):
        args["distributed_executor_backend"] = backend
    max_len = getattr(model, "max_model_len", None)
    return EngineSpec.model_validate({
        "mode": "serve", "tensor_parallel_size": size(parallel, "tensor_parallel_size"),
        "args": args, **({"max_model_len": max_len} if isinstance(max_len, int)
                         and max_len > 0 else {})})


def live_fault(body: Any, index: int, engine: EngineSpec) -> PlannedFault:
    """The fault a request's JSON ``body`` describes, as fault ``index`` of the live plan of a
    server that runs ``engine`` (``served_engine``); ``BadFault`` naming the field that is
    wrong. The fault follows the rules a scenario's fault follows (``ftkit validate``'s), on
    this server's engine."""
    if not isinstance(body, Mapping):
        raise BadFault("the request body must be a JSON object")
    unknown = sorted(set(body) - set(FAULT_KEYS))
    if unknown:
        raise BadFault(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(FAULT_KEYS)}")
    plan_id = body.get("id")
    if plan_id is not None and (not isinstance(plan_id, str) or not plan_id
                                or len(plan_id) > MAX_ID_CHARS):
        raise BadFault(f"id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    key, token, after = body.get("request_id"), body.get("token"), body.get("after_steps")
    if (key is None) == (after is None):
        raise BadFault("give either request_id (with token) or after_steps")
    if key is not None:
        if not isinstance(key, str) or not key:
            raise BadFault("request_id must be a non-empty string (the client's X-Request-Id)")
        if token is None:
            raise BadFault("request_id needs token: the output token (0 = prefill) the fault "
                           "hits")
    elif token is not None:
        raise BadFault("token goes with request_id; after_steps names a step by itself")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int)
                              or after < 0):
        raise BadFault("after_steps must be an integer >= 0")
    raw = {k: body[k] for k in ("kind", "rank", "phase", "times", "params") if k in body}
    raw["at"] = {"request": 0, "token": 0 if token is None else token}
    try:
        spec = FaultSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors())
        raise BadFault(problems) from None
    if spec.rank != "all" and spec.rank >= engine.ranks:
        raise BadFault(f"rank: {spec.rank} is not a rank of this server (it has "
                       f"{engine.ranks})")
    problems = fault_problems(engine, (), spec, rank_checked=True)
    if token is not None and spec.at.token >= engine.max_model_len:
        problems.append((("token",), f"token {spec.at.token} is never computed: the server's "
                                     f"max_model_len is {engine.max_model_len}"))
    if problems:
        raise BadFault("; ".join(f"{_body_field(loc)}: {message}" for loc, message in problems))
    from ftkit.inject import _pending

    planned = PlannedFault(index, spec, request_key=key, after_steps=after)
    try:
        pending = _pending(planned)  # the kind is implemented and its params are right
    except FtkitError as exc:
        raise BadFault(str(exc)) from None
    if after is not None and getattr(pending.params, "region", None) == "kv":
        raise BadFault(f"{spec.kind.value} on the KV cache hits the blocks of a request: give "
                       f"request_id and token, or another params.region")
    return planned


def _body_field(loc: tuple[Any, ...]) -> str:
    """The field of the route's body a scenario rule's location names (the body has
    ``token`` where a scenario has ``at.token``)."""
    if loc[:1] == ("at",):
        loc = loc[1:]
    return format_loc(loc) if loc else "body"


def describe(fault: PlannedFault) -> dict[str, Any]:
    """What was planned, as the route answers it."""
    spec = fault.spec
    where: dict[str, Any] = (
        {"request_id": fault.request_key, "token": spec.at.token}
        if fault.request_key is not None else {"after_steps": fault.after_steps})
    return {"index": fault.index, "kind": spec.kind.value, "rank": spec.rank,
            "phase": spec.phase, "times": spec.times, "params": dict(spec.params), **where}


@dataclass
class Control:
    """The injection state of one server: its settings, its secret, the faults it planned."""

    engine_client: Any
    config: RecoveryConfig | None
    secret: str | None
    #: The engine it runs, as a scenario's ``engine`` section (``served_engine``).
    engine: EngineSpec = field(default_factory=lambda: EngineSpec(mode="serve"))
    planned: int = 0
    #: Every live fault planned (``inject``), in order.
    faults: list[PlannedFault] = field(default_factory=list)
    #: The ranks' published records (``ftkit.serve.state``): what fired (``replan``).
    read_ranks: Callable[[], Mapping[int, Any]] | None = None

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()
        #: The plan calls that named an id: their body, and the call to the engine.
        self._by_id: dict[str, tuple[Mapping[str, Any], asyncio.Future[dict[str, Any]]]] = {}

    @classmethod
    def of_server(cls, engine_client: Any, additional_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] = os.environ) -> Control:
        """The control of a server started with ``additional_config``; ``FtkitError`` (the
        server does not start) where injection is on without a usable secret."""
        raw = (additional_config or {}).get(CONFIG_KEY)
        config = None if raw is None else RecoveryConfig.from_mapping(raw)
        secret = environ.get(SECRET_ENV) or None
        if config is not None and config.injection:  # (from_mapping: recovery is on)
            if secret is None or len(secret) < MIN_SECRET_CHARS:
                raise FtkitError(
                    f"{CONFIG_KEY}.injection is true but {SECRET_ENV} is "
                    f"{'unset' if secret is None else 'too short'}: set it in the server's "
                    f"environment to a secret of at least {MIN_SECRET_CHARS} characters")
        return cls(engine_client, config, secret,
                   served_engine(getattr(engine_client, "vllm_config", None)))

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.injection

    def check_secret(self, presented: str | None) -> None:
        """``Refused`` unless this server takes faults and ``presented`` is its secret."""
        if self.config is None:
            raise Refused(f"this server runs without ftkit's {CONFIG_KEY} settings; injection "
                          f"is off")
        if not self.config.injection:
            raise Refused(f"injection is off on this server: its {CONFIG_KEY} settings do not "
                          f'say "injection": true')
        assert self.secret is not None  # of_server refuses to start without one
        if presented is None or not hmac.compare_digest(presented.encode(),
                                                        self.secret.encode()):
            raise Refused(f"wrong or missing secret (header {SECRET_HEADER}; ftkit inject "
                          f"reads {SECRET_ENV} or --secret)")

    async def inject(self, body: Any, presented: str | None) -> dict[str, Any]:
        """Plan the fault of ``body`` on every rank; what was planned. ``Refused`` or
        ``BadFault`` when nothing was planned; ``EngineUnavailable`` when the engine did not
        take it (the answer says whether it may still: a call that reached the engine and
        timed out keeps its index, and the same call repeated with the same ``id`` answers
        its outcome, never plans it twice)."""
        self.check_secret(presented)
        if self.engine_client is None:
            raise EngineUnavailable("this server has no engine")
        plan_id = body.get("id") if isinstance(body, Mapping) else None
        async with self._lock:  # indices in order; the check and the plan are not interleaved
            earlier = self._by_id.get(plan_id) if isinstance(plan_id, str) else None
            if earlier is not None:
                if dict(earlier[0]) != dict(body):
                    raise BadFault(f"id {plan_id!r} named another fault before; give this one "
                                   f"an id of its own")
                call, repeated = earlier[1], True
            else:
                fault = live_fault(body, self.planned, self.engine)
                plan = FaultPlan(None, (fault,)).to_json()
                errors = await self._call(plan, check_only=True)
                if errors:
                    raise BadFault("; ".join(errors))
                # From here the index is spent: a call the engine answers too late still
                # plans the fault, and no other fault may take its index.
                self.planned += 1
                call, repeated = asyncio.ensure_future(self._plan(fault, plan, plan_id)), False
                if plan_id is not None:
                    self._by_id[plan_id] = (dict(body), call)
            try:
                planned = await asyncio.wait_for(asyncio.shield(call), RPC_TIMEOUT_S)
            except asyncio.TimeoutError:
                again = ("send the same call again (same id) for its outcome" if plan_id else
                         "a call with an id can be repeated safely")
                raise EngineUnavailable(
                    f"the engine did not answer within {RPC_TIMEOUT_S:.0f} s (a long recovery "
                    f"may be running): the fault may still be planned; {again}") from None
            except EngineUnavailable:
                if plan_id is not None and self._by_id.get(plan_id, (None, None))[1] is call:
                    del self._by_id[plan_id]  # not planned: the id may be used again
                raise
        return {"planned": planned, "repeated": True} if repeated else {"planned": planned}

    async def _plan(self, fault: PlannedFault, plan: str, plan_id: str | None
                    ) -> dict[str, Any]:
        """Plan checked ``fault`` on every rank (unbounded: ``inject`` bounds its wait, and a
        late answer still counts)."""
        errors = await self._call(plan, check_only=False, bounded=False)
        if errors:  # a rank that passed the check cannot fail here; say so if it does
            raise EngineUnavailable("ranks disagreed on a checked fault: " + "; ".join(errors))
        self.faults.append(fault)
        planned = describe(fault) | ({"id": plan_id} if plan_id is not None else {})
        log.warning("ftkit: planned live fault %s", planned)
        return planned

    async def replan(self, engine: Any) -> None:
        """Give ``engine``, which replaces a dead one (``ftkit.vllm.restart`` calls this before
        any request goes on there), the live faults planned for a request that have not failed
        all their attempts (the ranks' published records say which fired): planned for a
        request that was waiting, or that had not reached its token, they would otherwise be
        lost with the dead engine, though the request goes on. A fault planned by steps
        (``after_steps``) counted the dead engine's steps: its attempts left are dropped,
        and the server says so, once (the fault is forgotten)."""
        async with self._lock:
            if not self.faults:
                return
            fired = fired_attempts((self.read_ranks() if self.read_ranks else {}).values())
            again = [replace(f, fired=fired.get(f.index, 0)) for f in self.faults
                     if f.request_key is not None and fired.get(f.index, 0) < f.spec.times]
            dropped = [f.index for f in self.faults
                       if f.after_steps is not None and fired.get(f.index, 0) < f.spec.times]
            if dropped:
                log.warning("ftkit: live fault(s) %s, planned by steps of the dead engine, are "
                            "not planned on the new one", dropped)
                self.faults = [f for f in self.faults if f.index not in dropped]
            if not again:
                return
            plan = FaultPlan(None, tuple(again)).to_json()
            errors = await self._call(plan, check_only=False, engine=engine)
            if errors:
                log.error("ftkit: the new engine did not take the live faults %s: %s",
                          [f.index for f in again], "; ".join(errors))
                return
        log.warning("ftkit: live fault(s) %s planned again on the new engine (not fired, or "
                    "not all their attempts, before the engine died)", [f.index for f in again])

    async def _call(self, plan: str, *, check_only: bool, engine: Any = None,
                    bounded: bool = True) -> list[str]:
        client = self.engine_client if engine is None else engine
        try:
            answers = await asyncio.wait_for(
                client.collective_rpc(RPC_METHOD, args=(plan, check_only, self.secret)),
                RPC_TIMEOUT_S if bounded else None)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine did not take the fault within "
                                    f"{RPC_TIMEOUT_S:.0f} s (a long recovery may be running); "
                                    f"nothing was planned, try again") from None
        except Exception as exc:  # noqa: BLE001 - a dead engine, a failed call: tell the client
            raise EngineUnavailable(f"the engine could not be reached: {exc}") from None
        return [f"rank {a['rank']}: {a['error']}" for a in answers if a.get("error")]


class EndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry ``ftkit`` (``vllm.plugins.endpoint_plugins``)."""

    name = "ftkit"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from ftkit.serve import health, routes

        app.include_router(routes.router())
        health.attach(app)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from ftkit.serve import health

        control = Control.of_server(engine_client, getattr(args, "additional_config", None))
        state.ftkit_control = control
        await health.init_state(engine_client, state, args)
        server = getattr(state, "ftkit_health", None)
        if control.enabled and server is not None and server.state is not None:
            control.read_ranks = server.state.read
            # An engine that replaces a dead one gets the faults still to fire.
            hooks = getattr(engine_client, "on_replaced", None)
            if isinstance(hooks, list):
                hooks.append(control.replan)


def endpoint_plugin() -> EndpointPlugin:
    """The factory vLLM's endpoint plugin loader calls."""
    return EndpointPlugin()
