"""Starting vLLM's OpenAI server with ftkit's recovery: what ``ftkit serve`` checks and runs.

``plan_serve(model, options, environ)`` reads a server's options and environment and returns
the ``ServeLaunch`` to run, or raises ``FtkitError`` naming the option or variable to change.
In order:

1. The ``fault_tolerance`` settings in ``--additional-config`` (read as vLLM reads them:
   ``--additional-config X``, ``--additional-config=X``, the dotted
   ``--additional-config.fault_tolerance.enabled true``, and a ``--config`` YAML file) must be
   valid ``RecoveryConfig`` settings.
2. With recovery on, what it cannot handle is refused: ``--async-scheduling``, pipeline or
   data parallel sizes above 1, expert parallelism, speculative decoding, and
   ``--no-enforce-eager`` where it matters. ``--no-async-scheduling`` is added where absent
   (vLLM schedules ahead by default on GPU and NPU), and ``--enforce-eager`` with more than one
   rank or on CUDA (a rank blocked in a collective inside a compiled model cannot be stopped).
3. ``"injection": true`` needs the shared secret ``FTKIT_INJECT_SECRET`` (at least 16
   characters) in the environment: the server would refuse to start without it.
4. vLLM must load ftkit's plugins. ``VLLM_PLUGINS`` filters every plugin group, and endpoint
   plugins (ftkit's routes) load only where it names them: set without ``ftkit`` while the
   options carry ``fault_tolerance`` is an error (nobody would read the settings); unset, it
   is set to every plugin vLLM would have loaded anyway plus ``ftkit``, so that ftkit's routes
   are allowed and nothing that loaded before is switched off (vllm-ascend's platform plugin
   is one of them).
5. The engine environment ftkit's own engines run with, where unset: ``ENGINE_ENV``
   (``ftkit.vllm.environment``), on CPU also ``CPU_ENGINE_ENV`` (vLLM's compiled helpers run
   uncompiled: seconds less at an engine's start and at every replacement's first steps); on
   CPU with more than one rank, one core per rank
   (``VLLM_CPU_OMP_THREADS_BIND``); with recovery on, vLLM's execute timeout where it would
   end a step before its recovery is over.

The command is ``python -m vllm.entrypoints.openai.api_server --model MODEL OPTIONS...``: the
module form, because the ``vllm`` command fails at start on vllm-cpu (it looks up the
distribution ``vllm``), and with ``--model``, because the module's own start keeps a
positional model as an unused tag and would serve its default model instead.

Nothing here imports vLLM (the platform, where needed, is asked of ``ftkit.vllm.platform``)
and nothing starts a process: ``ftkit serve`` replaces itself with ``ServeLaunch.argv``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from ftkit import procs
from ftkit.bounds import VLLM_EXECUTE_TIMEOUT_ENV
from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.errors import FtkitError
from ftkit.model.moe import is_moe_model
from ftkit.procs import QUICK_EXIT_ENV
from ftkit.serve.control import MIN_SECRET_CHARS, SECRET_ENV
from ftkit.vllm.environment import (CPU_ENGINE_ENV, ENGINE_ENV, THREADS_BIND_ENV,
                                    cpu_threads_bind, engine_env, execute_timeout)

__all__ = [
    "ALLOW_LISTED_GROUPS",
    "ENDPOINT_PLUGINS_GROUP",
    "FTKIT_ENTRY_POINTS",
    "GENERAL_PLUGINS_GROUP",
    "PLUGIN_NAME",
    "PLUGINS_ENV",
    "PluginLoad",
    "SERVER_MODULE",
    "ServeLaunch",
    "allowed_plugins",
    "plan_serve",
    "plugin_load",
    "plugins_value",
]

#: The module ``ftkit serve`` runs: vLLM's OpenAI server.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: vLLM's allow-list of plugin names (comma separated; unset: every plugin of the groups below).
PLUGINS_ENV = "VLLM_PLUGINS"
#: The name of both of ftkit's vLLM entry points.
PLUGIN_NAME = "ftkit"
GENERAL_PLUGINS_GROUP = "vllm.general_plugins"
ENDPOINT_PLUGINS_GROUP = "vllm.endpoint_plugins"
#: The plugin groups vLLM loads whole while ``VLLM_PLUGINS`` is unset and filters by it once
#: set (``vllm.plugins.load_plugins_by_group``). Endpoint plugins are not among them: they load
#: only where ``VLLM_PLUGINS`` names them.
ALLOW_LISTED_GROUPS = (GENERAL_PLUGINS_GROUP, "vllm.platform_plugins",
                       "vllm.stat_logger_plugins", "vllm.io_processor_plugins")
#: ftkit's entry points: group -> the object each names.
FTKIT_ENTRY_POINTS = {
    GENERAL_PLUGINS_GROUP: "ftkit.vllm.plugin:register",
    ENDPOINT_PLUGINS_GROUP: "ftkit.serve.control:endpoint_plugin",
}

#: HCCL's asynchronous error handling (Ascend): on, it may end the process on a collective
#: error before the recovery round has run (vllm-ascend turns it off for its own fault
#: tolerance for the same reason).
HCCL_ASYNC_ERROR_HANDLING_ENV = "HCCL_ASYNC_ERROR_HANDLING"

#: The short forms vLLM's parser gives the options read here.
_ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
            "-dp": "--data-parallel-size", "-sc": "--speculative-config",
            "-ep": "--enable-expert-parallel"}
#: The options read here that take a value; the others read here are flags.
_VALUED = frozenset({"--additional-config", "--config", "--model", "--tensor-parallel-size",
                     "--pipeline-parallel-size", "--data-parallel-size",
                     "--speculative-config", "--spec-method", "--spec-model", "--spec-tokens"})
_FLAGS = frozenset({"--async-scheduling", "--no-async-scheduling", "--enforce-eager",
                    "--no-enforce-eager", "--enable-expert-parallel",
                    "--no-enable-expert-parallel"})
_SPECULATIVE = ("--speculative-config", "--spec-method", "--spec-model", "--spec-tokens")


# --- plugins ----------------------------------------------------------------------------------

def allowed_plugins(environ: Mapping[str, str]) -> list[str] | None:
    """``VLLM_PLUGINS`` as vLLM reads it: ``None`` when unset, else the comma-separated names
    (not stripped; an empty value allows no plugin)."""
    raw = environ.get(PLUGINS_ENV)
    return None if raw is None else raw.split(",")


def plugins_value(groups: Sequence[str] = ALLOW_LISTED_GROUPS) -> str:
    """The ``VLLM_PLUGINS`` that changes nothing vLLM loads where it is unset, and allows
    ftkit's endpoint plugin: the name of every installed entry point of ``groups``, then
    ``ftkit``."""
    names: list[str] = []
    for group in groups:
        names += [ep.name for ep in metadata.entry_points(group=group)]
    return ",".join([*dict.fromkeys(n for n in names if n != PLUGIN_NAME), PLUGIN_NAME])


@dataclass(frozen=True)
class PluginLoad:
    """Whether vLLM will load ftkit's entry point of ``group`` under an environment."""

    group: str
    #: The object ftkit's entry point of the group names (``module:object``), or ``None``
    #: where this environment has none.
    entry_point: str | None
    loaded: bool
    #: Why, in a sentence, with the fix where it is not loaded.
    detail: str


def plugin_load(group: str, environ: Mapping[str, str]) -> PluginLoad:
    """Whether vLLM, started under ``environ`` from this Python environment, loads ftkit's
    entry point of ``group`` (``GENERAL_PLUGINS_GROUP`` or ``ENDPOINT_PLUGINS_GROUP``): it is
    installed (visible to ``importlib.metadata``), names ftkit's object, imports, and
    ``VLLM_PLUGINS`` lets it through. Imports the entry point's module."""
    expected = FTKIT_ENTRY_POINTS[group]
    found = [ep for ep in metadata.entry_points(group=group) if ep.name == PLUGIN_NAME]
    if not found:
        return PluginLoad(group, None, False, (
            f"no entry point {PLUGIN_NAME!r} in {group} is installed in this Python "
            "environment: install ftkit into vLLM's environment (docs/install.md)"))
    value = found[0].value
    if value != expected:
        return PluginLoad(group, value, False, (
            f"the entry point {PLUGIN_NAME!r} in {group} names {value}, not {expected}: "
            "another package took the name, or an old ftkit is installed"))
    try:
        found[0].load()
    except Exception as exc:  # noqa: BLE001 - reported: vLLM logs it and goes on without
        return PluginLoad(group, value, False, (
            f"{value} cannot be imported ({type(exc).__name__}: {exc}): vLLM would log the "
            "error and go on without it"))
    allowed = allowed_plugins(environ)
    if allowed is None:
        if group == ENDPOINT_PLUGINS_GROUP:
            return PluginLoad(group, value, False, (
                f"{PLUGINS_ENV} is unset, and vLLM loads an endpoint plugin only where "
                f"{PLUGINS_ENV} names it: ftkit serve sets it; for a server started "
                f"otherwise, set {PLUGINS_ENV}={plugins_value()}"))
        return PluginLoad(group, value, True,
                          f"{PLUGINS_ENV} is unset: vLLM loads every installed plugin")
    if PLUGIN_NAME not in allowed:
        return PluginLoad(group, value, False, (
            f"{PLUGINS_ENV}={environ[PLUGINS_ENV]} does not name {PLUGIN_NAME}: add it "
            f"({PLUGINS_ENV}={environ[PLUGINS_ENV]},{PLUGIN_NAME})"))
    return PluginLoad(group, value, True, f"{PLUGINS_ENV} names {PLUGIN_NAME}")


# --- the server's options ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Option:
    """One occurrence of an option read here: its long name, its value (``None`` for a flag)
    and, for a dotted one (``--additional-config.fault_tolerance.enabled``), the key path."""

    name: str
    value: Any
    path: tuple[str, ...] = ()


def _long_name(token: str) -> str:
    """vLLM's spelling of an option: its short form expanded; underscores before the first
    dot turned into dashes."""
    if token in _ALIASES:
        return _ALIASES[token]
    if not token.startswith("--"):
        return token
    head, dot, rest = token[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest


def _read_options(tokens: Sequence[str]) -> list[_Option]:
    """The occurrences of the options read here, in order (the last one wins, as in vLLM);
    every other token is left to vLLM."""
    found, index = [], 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not token.startswith("-"):
            continue
        raw_name, has_value, inline = token.partition("=")
        name = _long_name(raw_name)
        base, dot, dotted = name.partition(".")
        if dot and base in _VALUED:
            if not has_value:
                value, index = _next_value(tokens, index, name)
            else:
                value = inline
            found.append(_Option(base, *_dotted_value(dotted, value)))
        elif name in _VALUED:
            if not has_value:
                inline, index = _next_value(tokens, index, name)
            found.append(_Option(name, inline))
        elif name in _FLAGS:
            found.append(_Option(name, None))
    return found


def _next_value(tokens: Sequence[str], index: int, name: str) -> tuple[str, int]:
    if index >= len(tokens):
        raise FtkitError(f"{name}: give it a value")
    return tokens[index], index + 1


def _dotted_value(dotted: str, value: str) -> tuple[Any, tuple[str, ...]]:
    """``--X.a.b VALUE`` as vLLM reads it: the value as JSON where it is JSON (else the
    text), a ``+`` suffix making a list of its comma-separated items."""
    if dotted.endswith("+"):
        return value.split(","), tuple(dotted[:-1].split("."))
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return parsed, tuple(dotted.split("."))


def _config_file_tokens(path: str) -> list[str]:
    """The options of a ``--config`` YAML file, as vLLM turns them into command-line words
    (``vllm.utils.argparse_utils.FlexibleArgumentParser.load_config_file``)."""
    if not path.endswith((".yaml", ".yml")):
        raise FtkitError(f"--config {path}: vLLM reads only .yaml or .yml files")
    try:
        with open(path, encoding="utf-8") as file:
            config = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FtkitError(f"--config {path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise FtkitError(f"--config {path}: must hold a mapping of option names to values")
    tokens: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            tokens.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, list):
            tokens += [f"--{key}", *(str(item) for item in value)] if value else []
        elif isinstance(value, dict):
            tokens += [f"--{key}", json.dumps(value)]
        else:
            tokens += [f"--{key}", str(value)]
    return tokens


@dataclass(frozen=True)
class _Settings:
    """What the options say about what ftkit checks: the last occurrence of each option wins,
    as in vLLM."""

    options: list[_Option]

    def last(self, *names: str) -> _Option | None:
        return next((o for o in reversed(self.options) if o.name in names and not o.path),
                    None)

    def on(self, flag: str) -> bool:
        """Whether the boolean option ``flag`` ends up on (``--X`` after any ``--no-X``)."""
        last = self.last(flag, "--no-" + flag[2:])
        return last is not None and last.name == flag

    def size(self, name: str) -> int:
        last = self.last(name)
        if last is None:
            return 1
        try:
            return int(last.value)
        except ValueError:
            raise FtkitError(f"{name} {last.value}: must be a whole number") from None

    def additional_config(self) -> dict[str, Any]:
        """vLLM's ``additional_config``: its dotted options merged (vLLM passes them last, so
        they replace a plain one), else the last plain one."""
        dotted = [o for o in self.options if o.name == "--additional-config" and o.path]
        if dotted:
            merged: dict[str, Any] = {}
            for option in dotted:
                _merge(merged, option.path, option.value)
            return merged
        last = self.last("--additional-config")
        if last is None or last.value in ("", "None"):
            return {}
        try:
            value = json.loads(last.value)
        except json.JSONDecodeError as exc:
            raise FtkitError(f"--additional-config: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise FtkitError("--additional-config: must be a JSON object, such as "
                             '\'{"fault_tolerance": {"enabled": true}}\'')
        return value

    def speculative_option(self) -> str | None:
        """The option that turns speculative decoding on, or ``None``."""
        for option in reversed(self.options):
            if option.name in _SPECULATIVE and (option.path or option.value
                                                not in ("", "None", "null")):
                return option.name
        return None


def _merge(into: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in ``into`` as vLLM merges dotted options (a later value
    wins; lists are joined)."""
    *parents, leaf = path
    for key in parents:
        if not isinstance(into.get(key), dict):
            into[key] = {}
        into = into[key]
    if isinstance(value, list) and isinstance(into.get(leaf), list):
        into[leaf] = into[leaf] + value
    else:
        into[leaf] = value


# --- the launch -------------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnTempFolder:
    """A launch with a temporary folder of its own (``ServeLaunch.with_own_temp_folder``)."""

    launch: ServeLaunch
    watchdog: procs.Watchdog
    #: For the person, where the folder could not go inside ``TMPDIR`` (a path too long for
    #: vLLM's sockets).
    note: str | None = None

    def undo(self) -> None:
        """End the watchdog and remove the folder: the server did not start."""
        self.watchdog.stop()
        procs.remove_files([self.launch.env["TMPDIR"]])


#: The longest path of a Unix socket (``sockaddr_un.sun_path``, less its final NUL).
MAX_SOCKET_PATH = 107
#: Where ``ftkit serve``'s temporary folder goes when ``TMPDIR`` is too deep for it.
FALLBACK_TEMP = "/tmp"


@dataclass(frozen=True)
class ServeLaunch:
    """What ``ftkit serve`` runs: ``argv`` under ``env`` (the whole environment)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    #: The ``fault_tolerance`` settings, or ``None`` where the options carry none.
    recovery: RecoveryConfig | None
    #: What ftkit added to the options or set in the environment, one sentence each.
    notes: tuple[str, ...] = ()
    #: The variables ftkit reads or sets, for a person to see (never the secret).
    shown: tuple[str, ...] = field(default=())

    def shown_env(self) -> dict[str, str]:
        """The values of the variables ftkit reads or sets, as the server will have them."""
        return {k: self.env[k] for k in self.shown if k in self.env}

    def with_own_temp_folder(self) -> OwnTempFolder:
        """This launch with a temporary folder of the server's own (``TMPDIR``, inside the
        one it would have used), which a watchdog removes once the server is gone, however
        it ends (SIGTERM, SIGINT, SIGKILL): vLLM leaves its IPC sockets and its store of the
        distributed group there, and nothing of vLLM's removes them when its processes are
        killed. The watchdog also ends the server's processes that outlive it (vLLM's engine
        core and workers go on running when the server is SIGKILLed). Call it just before
        this process becomes the server (``os.execve``: the watchdog watches this process's
        pid); ``OwnTempFolder.undo`` where the server never starts."""
        parent = self.env.get("TMPDIR") or tempfile.gettempdir()
        note = None
        # vLLM names its sockets <TMPDIR>/<uuid4>: a Unix socket path has at most 107 bytes.
        if len(os.path.join(parent, "ftkit-serve-xxxxxxxx", "x" * 36)) > MAX_SOCKET_PATH:
            note = (f"the server's temporary folder is in {FALLBACK_TEMP}, not in TMPDIR "
                    f"({parent}): in it, vLLM's socket paths would be longer than the "
                    f"{MAX_SOCKET_PATH} bytes a Unix socket path may have")
            parent = FALLBACK_TEMP
        folder = tempfile.mkdtemp(prefix="ftkit-serve-", dir=parent)
        watchdog = procs.Watchdog(os.path.join(folder, "ftkit-watch-record"),
                                  descendants=True).start()
        watchdog.note_paths([folder])
        return OwnTempFolder(replace(self, env={**self.env, "TMPDIR": folder}), watchdog, note)


def plan_serve(model: str, options: Sequence[str], environ: Mapping[str, str], *,
               python: str, device_type: Callable[[], str] | str | None = None,
               cores: Collection[int] | None = None) -> ServeLaunch:
    """The server ``ftkit serve MODEL OPTIONS...`` starts under ``environ`` with the
    interpreter ``python``; ``FtkitError`` naming what to change where it would not run
    ftkit's recovery as asked.

    ``device_type``: the platform (``cpu``, ``cuda``, ``npu``), or what tells it; by default
    vLLM's detection, asked only where it matters (more than one rank, or recovery on).
    ``cores``: the cores the server may run on (default: this process's)."""
    if not model or model.startswith("-"):
        raise FtkitError("give the model first: ftkit serve MODEL [vLLM server options...]")
    options = list(options)
    settings = _Settings(_read_options(_with_config_file(options)))
    if settings.last("--model") is not None:
        raise FtkitError(f"--model: give the model once, as ftkit serve MODEL (here {model})")
    recovery = _recovery(settings.additional_config())
    recovering = recovery is not None and recovery.enabled
    platform = _Platform(device_type)
    notes: list[str] = []
    tp = settings.size("--tensor-parallel-size")
    if recovering:
        # torch.compile puts a rank's collectives inside a compiled graph, where a rank blocked
        # in one cannot be stopped; on CUDA a captured graph's collectives cannot be waited for
        # on the host (ftkit.vllm.runner_state.config_problems).
        needs_eager = tp > 1 or platform.get() == "cuda"
        _refuse_what_recovery_cannot_roll_back(settings, needs_eager, model)
        if settings.last("--no-async-scheduling") is None:
            options.append("--no-async-scheduling")
            notes.append("added --no-async-scheduling: recovery re-runs a step, which a step "
                         "scheduled ahead of it would not allow")
        if needs_eager and not settings.on("--enforce-eager"):
            options.append("--enforce-eager")
            notes.append("added --enforce-eager: recovery cannot stop a rank inside a compiled "
                         "model (torch.compile, CUDA graphs)")
    env = dict(environ)
    if recovery is not None and recovery.injection:
        _require_secret(env)
        if env.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() not in ("", "0", "false"):
            notes.append("VLLM_SERVER_DEV_MODE is set: vLLM's development routes "
                         "(/collective_rpc, /pause) are open to anyone who reaches the port; "
                         "ftkit's workers plan no fault through them without the secret")
    notes += _plugins(env, recovery)
    collective = _collective_error_env(platform.get()) if recovering else {}
    # (A server with data parallelism runs one engine of tp ranks per replica; every rank
    # of every replica gets a core of its own.)
    replicas = settings.size("--data-parallel-size")
    notes += _engine_env(env, recovery, tp, platform, cores, collective, ranks=tp * replicas)
    argv = (python, "-m", SERVER_MODULE, "--model", model, *options)
    shown = (*ENGINE_ENV, *CPU_ENGINE_ENV, THREADS_BIND_ENV, VLLM_EXECUTE_TIMEOUT_ENV,
             *collective, PLUGINS_ENV)
    return ServeLaunch(argv, env, recovery, tuple(notes), shown)


def _with_config_file(options: list[str]) -> list[str]:
    """``options`` with a ``--config`` file's options in its place, where vLLM puts them
    (before the others, which win over them)."""
    for index, token in enumerate(options):
        if token == "--config" or token.startswith("--config="):
            name, has_value, path = token.partition("=")
            rest = options[index + 1:]
            if not has_value:
                if not rest:
                    raise FtkitError("--config: give it a value")
                path, rest = rest[0], rest[1:]
            return [*_config_file_tokens(path), *options[:index], *rest]
    return options


def _recovery(extra: Mapping[str, Any]) -> RecoveryConfig | None:
    if CONFIG_KEY not in extra:
        return None
    try:
        return RecoveryConfig.from_mapping(extra[CONFIG_KEY])
    except (FtkitError, TypeError) as exc:
        raise FtkitError(f"--additional-config: {exc}") from None


def _refuse_what_recovery_cannot_roll_back(settings: _Settings, needs_eager: bool,
                                          model: str) -> None:
    """``FtkitError`` with one line per option that turns on what recovery cannot handle,
    each naming the option (as given) and its fix; ``needs_eager``: a compiled model is one
    of them. Data parallelism is refused for an MoE ``model`` only (its replicas are
    coupled); a dense model's replicas are independent engines, each recovered on its own.
    (A model that is not a local folder is checked when its engine starts:
    ``ftkit.vllm.runner_state.config_problems``.)"""
    problems = []  # (the option as given, what it turns on, the fix)
    if settings.on("--async-scheduling"):
        problems.append(("--async-scheduling", "asynchronous scheduling",
                         "remove it (ftkit serve then adds --no-async-scheduling)"))
    size = settings.size("--pipeline-parallel-size")
    if size > 1:
        problems.append((f"--pipeline-parallel-size {size}", "pipeline parallelism",
                         "serve with --pipeline-parallel-size 1 (or without it)"))
    size = settings.size("--data-parallel-size")
    if size > 1 and is_moe_model(model):
        problems.append((f"--data-parallel-size {size}",
                         "data parallelism of an MoE model (its replicas are coupled: they "
                         "run every step together, and vLLM-CPU's communicator lacks the "
                         "all_gatherv they need)",
                         "serve with --data-parallel-size 1 (or without it)"))
    if settings.on("--enable-expert-parallel"):
        problems.append(("--enable-expert-parallel", "expert parallelism", "remove it"))
    speculative = settings.speculative_option()
    if speculative is not None:
        problems.append((speculative, "speculative decoding", "remove it"))
    if needs_eager and settings.last("--enforce-eager", "--no-enforce-eager") is not None \
            and not settings.on("--enforce-eager"):
        problems.append(("--no-enforce-eager", "a compiled model (torch.compile at more than "
                         "one rank, CUDA graphs)", "remove it (ftkit serve then adds "
                         "--enforce-eager)"))
    if problems:
        raise FtkitError("\n".join(
            f"{option}: ftkit's recovery does not support {feature}: {fix}, or turn recovery "
            f"off (\"enabled\": false in {CONFIG_KEY})" for option, feature, fix in problems))


def _require_secret(env: Mapping[str, str]) -> None:
    secret = env.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET_CHARS:
        state = "is not set" if not secret else f"has {len(secret)} characters"
        raise FtkitError(
            f'{CONFIG_KEY}: "injection": true needs the shared secret {SECRET_ENV} '
            f"of at least {MIN_SECRET_CHARS} characters in the environment (it "
            f"{state}): set it, or leave injection off")


def _plugins(env: dict[str, str], recovery: RecoveryConfig | None) -> list[str]:
    allowed = allowed_plugins(env)
    if allowed is None:
        env[PLUGINS_ENV] = plugins_value()
        return [f"set {PLUGINS_ENV}={env[PLUGINS_ENV]}: every vLLM plugin installed here, "
                "as with it unset, and ftkit's routes (vLLM loads an endpoint plugin only "
                f"where {PLUGINS_ENV} names it)"]
    if PLUGIN_NAME not in allowed and recovery is not None:
        raise FtkitError(
            f"{PLUGINS_ENV}={env[PLUGINS_ENV]} does not name {PLUGIN_NAME}, so vLLM would "
            f"not load ftkit and nobody would read the {CONFIG_KEY} settings: set "
            f"{PLUGINS_ENV}={env[PLUGINS_ENV]},{PLUGIN_NAME} (or unset it, and ftkit serve "
            "sets it)")
    return []


class _Platform:
    """The platform, asked of vLLM at most once and only where it matters."""

    def __init__(self, device_type: Callable[[], str] | str | None) -> None:
        self._source = device_type
        self._value: str | None = device_type if isinstance(device_type, str) else None

    def get(self) -> str:
        if self._value is None:
            if self._source is None:
                from ftkit.vllm.platform import current_device_type

                self._value = current_device_type()
            else:
                self._value = self._source()
        return self._value


def _engine_env(env: dict[str, str], recovery: RecoveryConfig | None, tp: int,
                platform: _Platform, cores: Collection[int] | None,
                collective: Mapping[str, str], ranks: int) -> list[str]:
    """``ranks``: every rank of the server (``tp`` per engine, one engine per data-parallel
    replica), each bound to a core of its own on CPU (vLLM gives replica ``i`` the ``i``-th
    ``tp`` entries of the binding)."""
    set_here = {k: v for k, v in engine_env(platform.get()).items() if k not in env}
    if ranks > 1 and THREADS_BIND_ENV not in env and platform.get() == "cpu":
        set_here[THREADS_BIND_ENV] = cpu_threads_bind(
            ranks, os.sched_getaffinity(0) if cores is None else cores)
    if VLLM_EXECUTE_TIMEOUT_ENV not in env:
        timeout = execute_timeout(recovery, tp, env)
        if timeout is not None and timeout.short:
            set_here[VLLM_EXECUTE_TIMEOUT_ENV] = str(timeout.seconds)
    set_here.update({k: v for k, v in collective.items() if k not in env})
    if QUICK_EXIT_ENV not in env:
        set_here[QUICK_EXIT_ENV] = "1"  # the engine's spawned processes end without teardown
    env.update(set_here)
    if not set_here:
        return []
    return ["set " + ", ".join(f"{k}={v}" for k, v in set_here.items())
            + " (the engine environment ftkit's own engines run with; a value already in the "
              "environment is kept)"]



def _collective_error_env(device_type: str) -> dict[str, str]:
    """What keeps the platform's collective library from ending the process on a collective
    error before the recovery round has run (CUDA: torch's NCCL watchdog; Ascend: HCCL)."""
    if device_type == "cuda":
        from ftkit.backends.cuda import ASYNC_ERROR_HANDLING_ENV

        return {ASYNC_ERROR_HANDLING_ENV: "0"}
    if device_type == "npu":
        return {HCCL_ASYNC_ERROR_HANDLING_ENV: "0"}
    return {}
