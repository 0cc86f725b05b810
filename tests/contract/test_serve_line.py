"""Every server line the documentation gives is accepted, on its platform, by what runs it and
by ftkit's supported-configuration check (``check_supported``), and every setting it names is
a real one.

A documented line is a fenced code block right after a marker comment (invisible once
rendered); every block in README.md and docs/ that starts a server must carry one, so no line
escapes the test:

* ``<!-- ftkit-serve: PLATFORM -->`` before an ``ftkit serve`` line, PLATFORM ``any`` where the
  line is meant for every platform;
* ``<!-- vllm-serve: PLATFORM -->`` before a ``vllm serve`` line or a line of the module form,
  ``python -m vllm.entrypoints.openai.api_server``;

PLATFORM one of ``cpu``, ``cuda``, ``ascend``. In the block, ``export NAME=VALUE`` lines and
``NAME=VALUE`` words before the command set the environment the line runs with.

An ``ftkit serve`` line runs as ``ftkit serve --dry-run`` on each of its platforms (vLLM's
platform detection answers the platform): it must pass ftkit serve's own checks, and the
command and environment it prints must then pass as a module-form line does.

A ``vllm serve`` line goes through the parser ``vllm serve`` builds
(``ServeSubcommand.subparser_init``), a module-form line through the one the module builds
(``make_arg_parser`` on a ``FlexibleArgumentParser``, which keeps a positional model as an
unused tag: the model must be ``--model``); then their own validation and
``AsyncEngineArgs.from_cli_args``. The ``fault_tolerance`` settings must be valid ftkit
settings that turn recovery on. Then the configuration the model runner would have goes
through ``check_supported``:

* CPU: vLLM's real configuration (``create_engine_config``) with the embedded tiny model in
  place of the documented model, under the line's environment;
* CUDA and Ascend (no GPU or NPU here): the engine arguments with vLLM 0.32's defaults for what
  they leave unset, as ``vllm/config/vllm.py`` decides them on a GPU: asynchronous scheduling on,
  the V2 model runner unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise, CUDA graphs and
  torch.compile unless ``--enforce-eager``. vllm-ascend follows the same variable and defaults.

Every variable a block sets must be read by something: vLLM (``vllm.envs``) or a reader named
in ``OTHER_VARIABLES``; every key of the README's settings table must be a recovery setting.
The negative cases drop one setting from a documented line (or spoil one) and expect the
refusal that names it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from vllm import envs
from vllm.config import CompilationMode, CUDAGraphMode
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ftkit.backends.cuda import ASYNC_ERROR_HANDLING_ENV
from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.errors import FtkitError
from ftkit.model import resolve_model
from ftkit.serve import launch
from ftkit.serve.control import SECRET_ENV
from ftkit.vllm import platform as vllm_platform
from ftkit.vllm.runner_state import check_supported
from ftkit_cli.main import ftkit

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PLATFORMS = ("cpu", "cuda", "ascend")
#: The device type vLLM's detection gives on each platform.
DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "ascend": "npu"}
MARKER = re.compile(r"<!--\s*(ftkit|vllm)-serve:\s*(\w+)\s*-->")
FENCE = re.compile(r"^(```|~~~)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
#: The commands a block may start a server with, by the marker they need.
COMMANDS = {("ftkit", "serve"): "ftkit", ("vllm", "serve"): "vllm",
            ("python", "-m", launch.SERVER_MODULE): "vllm",
            ("python3", "-m", launch.SERVER_MODULE): "vllm"}
#: Variables the documentation sets that vLLM does not read, each with what reads it.
OTHER_VARIABLES = {
    ASYNC_ERROR_HANDLING_ENV: "torch's NCCL process group (ftkit.backends.cuda)",
    launch.HCCL_ASYNC_ERROR_HANDLING_ENV: "HCCL (docs/ascend.md)",
    SECRET_ENV: "ftkit's routes (ftkit.serve.control)",
}
#: What ftkit serve sets or reads: a documented ftkit serve line starts without them, unless it
#: sets them itself.
FTKIT_SERVE_ENV = ("VLLM_PLUGINS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_V2_MODEL_RUNNER",
                   "VLLM_CPU_ATTN_SPLIT_KV", "TORCH_COMPILE_DISABLE", "VLLM_CPU_OMP_THREADS_BIND",
                   "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", ASYNC_ERROR_HANDLING_ENV,
                   launch.HCCL_ASYNC_ERROR_HANDLING_ENV, SECRET_ENV)


@dataclass
class ServeLine:
    where: str
    platform: str | None
    #: ``ftkit`` (``ftkit serve``), ``vllm`` (``vllm serve``) or ``module``.
    kind: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def without(self, *, flag: str | None = None, variable: str | None = None) -> ServeLine:
        assert flag is None or flag in self.argv, f"{self.where} has no {flag}"
        assert variable is None or variable in self.env, f"{self.where} does not set {variable}"
        return ServeLine(self.where, self.platform, self.kind,
                         [a for a in self.argv if a != flag],
                         {k: v for k, v in self.env.items() if k != variable})

    def plus(self, *argv: str) -> ServeLine:
        return ServeLine(self.where, self.platform, self.kind, [*self.argv, *argv], self.env)


def fenced_blocks(text: str) -> list[tuple[int, tuple[str, str] | None, str]]:
    """(line number, (marker command, platform) or None, body) of every fenced block."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            start = index
            index += 1
            while index < len(lines) and not FENCE.match(lines[index]):
                index += 1
            previous = lines[start - 1] if start else ""
            marker = MARKER.search(previous)
            blocks.append((start + 1, marker.groups() if marker else None,
                           "\n".join(lines[start + 1:index])))
        index += 1
    return blocks


def _command(words: list[str]) -> tuple[tuple[str, ...], str] | None:
    """(the words of the command, its kind) where ``words`` start a server."""
    for prefix in COMMANDS:
        if tuple(words[:len(prefix)]) == prefix:
            return prefix, ("module" if "-m" in prefix else prefix[0])
    return None


def serve_command(body: str, where: str) -> ServeLine | None:
    """The one server command of a block, with its environment; ``None`` if none."""
    env: dict[str, str] = {}
    found: list[ServeLine] = []
    for command in body.replace("\\\n", " ").splitlines():
        if not command.lstrip().startswith("export ") and not any(
                " ".join(prefix) in command for prefix in COMMANDS):
            continue  # (other lines need not even be shell words)
        words = shlex.split(command, comments=True)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
            continue
        inline = {}
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            inline[name] = value
        started = _command(words)
        if started is not None:
            prefix, kind = started
            found.append(ServeLine(where, None, kind, words[len(prefix):], {**env, **inline}))
    assert len(found) <= 1, f"{where}: one server command per block"
    return found[0] if found else None


def documented_lines(paths: list[Path] = DOCUMENTS) -> list[ServeLine]:
    lines = []
    for path in paths:
        for number, marker, body in fenced_blocks(path.read_text()):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
            line = serve_command(body, where)
            if line is None:
                continue
            wanted = "ftkit" if line.kind == "ftkit" else "vllm"
            platforms = PLATFORMS + (("any",) if wanted == "ftkit" else ())
            assert marker is not None and marker[0] == wanted and marker[1] in platforms, (
                f"{where}: this block needs a <!-- {wanted}-serve: PLATFORM --> line right "
                f"before it, PLATFORM one of {', '.join(platforms)}")
            line.platform = marker[1]
            lines.append(line)
    return lines


LINES = documented_lines()


def documented(kind: str, platform: str, document: str) -> ServeLine:
    [line] = [x for x in LINES if x.kind == kind and x.platform == platform
              and x.where.startswith(document + ":")]
    return line


def cases(lines: list[ServeLine]) -> list[tuple[ServeLine, str]]:
    """(line, platform) for every platform each line is meant for."""
    return [(line, platform) for line in lines
            for platform in (PLATFORMS if line.platform == "any" else (line.platform,))]


# --- what runs a line, then ftkit's check ------------------------------------------------------

def parse(line: ServeLine) -> AsyncEngineArgs:
    """What ``vllm serve`` or the module makes of the line's arguments (``SystemExit`` on a
    bad one)."""
    parser = FlexibleArgumentParser(prog="vllm")
    if line.kind == "vllm":
        command = ServeSubcommand()
        command.subparser_init(parser.add_subparsers(dest="subparser"))
        args = parser.parse_args(["serve", *line.argv])
        command.validate(args)
        if args.model_tag is not None:
            args.model = args.model_tag
    else:
        args = make_arg_parser(parser).parse_args(line.argv)
        validate_parsed_serve_args(args)
        assert args.model_tag is None, (
            f"{line.where}: the module form serves --model and ignores a positional model "
            f"({args.model_tag})")
    return AsyncEngineArgs.from_cli_args(args)


class V2ModelRunner:
    """vLLM's V2 runner as ``check_supported`` sees it: no V1 batch bookkeeping."""


V2ModelRunner.__name__ = V2ModelRunner.__qualname__ = "GPUModelRunner"
V2ModelRunner.__module__ = "vllm.v1.worker.gpu.model_runner"


def runner(*, v2: bool, async_scheduling: bool, device: Any, compilation_config: Any,
           parallel_config: Any, speculative_config: Any) -> Any:
    """The attributes ``check_supported`` reads of the model runner vLLM would build."""
    state = V2ModelRunner() if v2 else SimpleNamespace(input_batch=object(), requests={})
    state.use_async_scheduling = async_scheduling
    state.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
    state.parallel_config = parallel_config
    state.speculative_config = speculative_config
    state.device = device
    state.compilation_config = compilation_config
    return state


def cpu_runner(engine: AsyncEngineArgs) -> Any:
    engine.model = engine.tokenizer = str(resolve_model("tiny"))
    config = engine.create_engine_config()
    if replica_dp_size(engine) == 1:
        # As each engine core of a dense model's replica does (vllm.v1.engine.core).
        config.parallel_config.reconfigure_for_independent_dp_rank()
    return runner(v2=config.use_v2_model_runner,
                  async_scheduling=bool(config.scheduler_config.async_scheduling),
                  device=torch.device("cpu"), compilation_config=config.compilation_config,
                  parallel_config=config.parallel_config,
                  speculative_config=config.speculative_config)


def replica_dp_size(engine: AsyncEngineArgs) -> int:
    """The data-parallel size each engine of the line sees: vLLM runs each replica of a dense
    model as an engine of its own, of size 1 (``reconfigure_for_independent_dp_rank``); an
    MoE model's coupled replicas keep the line's."""
    return engine.data_parallel_size if launch.is_moe_model(engine.model) else 1


def accelerator_runner(engine: AsyncEngineArgs, platform: str) -> Any:
    # vLLM's own reading of the variable ("0", "false", "1", ...); unset means the V2 runner
    # on a GPU with Triton (VllmConfig.use_v2_model_runner).
    v2 = envs.VLLM_USE_V2_MODEL_RUNNER
    device = torch.device("cuda", 0) if platform == "cuda" else SimpleNamespace(type="npu")
    eager = bool(engine.enforce_eager)
    return runner(
        v2=True if v2 is None else bool(v2),
        # Unset: on, where nothing rules it out (VllmConfig, "Enable async scheduling unless
        # there is an incompatible option").
        async_scheduling=True if engine.async_scheduling is None else engine.async_scheduling,
        device=device,
        # Eager mode turns both off; otherwise optimization level 2 compiles with vLLM's
        # compiler and captures CUDA graphs (VllmConfig.__post_init__).
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.NONE if eager else CUDAGraphMode.FULL_AND_PIECEWISE,
            mode=CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            data_parallel_size=replica_dp_size(engine),
            enable_expert_parallel=engine.enable_expert_parallel),
        speculative_config=engine.speculative_config)


def check_vllm(line: ServeLine, platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``vllm serve`` or module-form line; raises ``FtkitError`` where ftkit would refuse
    it at start."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    for name, value in line.env.items():
        monkeypatch.setenv(name, value)
    engine = parse(line)
    settings = RecoveryConfig.from_mapping(engine.additional_config[CONFIG_KEY])
    assert settings.enabled, f"{line.where}: recovery is not turned on"
    model_runner = (cpu_runner(engine) if platform == "cpu"
                    else accelerator_runner(engine, platform))
    check_supported(model_runner)


def dry_run(line: ServeLine, platform: str, monkeypatch: pytest.MonkeyPatch) -> ServeLine:
    """What ``ftkit serve --dry-run`` makes of an ``ftkit serve`` line on ``platform``: the
    module-form line it would run (``FtkitError`` with its message where it refuses)."""
    monkeypatch.setattr(vllm_platform, "current_device_type", lambda: DEVICE_TYPES[platform])
    env = {**{name: None for name in FTKIT_SERVE_ENV}, **line.env}
    if '"injection": true' in " ".join(line.argv):
        # The page says to give the server its secret in the environment first.
        env["FTKIT_INJECT_SECRET"] = env.get("FTKIT_INJECT_SECRET") or "a-secret-of-16-chars+"
    result = CliRunner().invoke(ftkit, ["serve", "--dry-run", *line.argv], env=env)
    if result.exit_code == 2:
        raise FtkitError(result.stderr)
    assert result.exit_code == 0, result.output
    *exports, command = result.stdout.strip().splitlines()
    shown = dict(shlex.split(export)[1].split("=", 1) for export in exports)
    words = shlex.split(command)
    assert words[1:3] == ["-m", launch.SERVER_MODULE], command
    return ServeLine(line.where, platform, "module", words[3:], {**line.env, **shown})


def check(line: ServeLine, platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raises ``FtkitError`` where ftkit (``ftkit serve``, or the engine at start) would
    refuse the line on ``platform``."""
    if line.kind == "ftkit":
        line = dry_run(line, platform, monkeypatch)
    check_vllm(line, platform, monkeypatch)


def unknown_variables(line: ServeLine) -> list[str]:
    return sorted(name for name in line.env
                  if name not in envs.environment_variables and name not in OTHER_VARIABLES)


def table_keys(text: str) -> list[str]:
    """The keys of the recovery settings table: the first cells of the table whose header
    starts with ``| Key |``."""
    table = text[text.index("| Key |"):].split("\n\n", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", table, re.M)


# --- the documented lines ------------------------------------------------------------------------

def test_the_readme_documents_ftkit_serve_for_every_platform():
    assert [x.platform for x in LINES if x.where.startswith("README.md:")
            and x.kind == "ftkit"] == ["any"]


def test_the_serving_page_documents_a_line_of_its_own_for_every_platform():
    lines = [x for x in LINES if x.where.startswith("docs/serving.md:") and x.kind != "ftkit"]
    assert sorted(x.platform for x in lines) == sorted(PLATFORMS)
    # On CPU the vllm command fails at start (vllm-cpu): the module form there.
    assert {x.platform: x.kind for x in lines}["cpu"] == "module"


@pytest.mark.parametrize("line,platform", cases(LINES),
                         ids=lambda x: x if isinstance(x, str) else f"{x.kind}-{x.where}")
def test_every_documented_line_is_accepted(line, platform, monkeypatch):
    check(line, platform, monkeypatch)


@pytest.mark.parametrize("line", LINES, ids=lambda x: f"{x.kind}-{x.where}")
def test_every_variable_a_line_sets_is_read_by_something(line):
    assert unknown_variables(line) == []


def test_every_key_of_the_readme_table_is_a_recovery_setting():
    keys = table_keys(README.read_text())
    assert keys and set(keys) <= {f.name for f in fields(RecoveryConfig)}


# --- the checks can fail -------------------------------------------------------------------------

@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_without_no_async_scheduling_the_line_is_refused(platform, monkeypatch):
    line = documented("vllm", platform, "docs/serving.md").without(flag="--no-async-scheduling")
    with pytest.raises(FtkitError, match="--no-async-scheduling"):
        check(line, platform, monkeypatch)


@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_without_the_v1_runner_the_line_is_refused(platform, monkeypatch):
    line = documented("vllm", platform, "docs/serving.md").without(
        variable="VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(FtkitError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check(line, platform, monkeypatch)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_without_enforce_eager_the_tp2_line_is_refused(platform, monkeypatch):
    line = documented("vllm" if platform != "cpu" else "module", platform, "docs/serving.md")
    with pytest.raises(FtkitError, match="--enforce-eager"):
        check(line.without(flag="--enforce-eager"), platform, monkeypatch)


def test_a_positional_model_in_the_module_form_is_caught(monkeypatch):
    line = documented("module", "cpu", "docs/serving.md")
    model = line.argv.index("--model")
    positional = ServeLine(line.where, "cpu", "module",
                           line.argv[:model] + line.argv[model + 1:], line.env)
    with pytest.raises(AssertionError, match="ignores a positional model"):
        check(positional, "cpu", monkeypatch)


def test_a_flag_vllm_does_not_know_is_caught_by_its_parser(monkeypatch):
    line = documented("module", "cpu", "docs/serving.md").plus("--no-such-flag")
    with pytest.raises(SystemExit):
        check(line, "cpu", monkeypatch)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ftkit_serve_refuses_what_the_engine_would(platform, monkeypatch):
    line = documented("ftkit", "any", "README.md")
    with pytest.raises(FtkitError, match="--async-scheduling: ftkit's recovery does not"):
        check(line.plus("--async-scheduling"), platform, monkeypatch)
    spoiled = ServeLine(line.where, "any", "ftkit",
                        [a.replace('"enabled"', '"enable"') for a in line.argv], line.env)
    with pytest.raises(FtkitError, match="unknown key"):
        check(spoiled, platform, monkeypatch)


def test_ftkit_serve_s_own_additions_are_what_makes_its_line_pass(monkeypatch):
    """The line ftkit serve runs passes the engine's check on CUDA; without the options it
    adds, it would not."""
    run = dry_run(documented("ftkit", "any", "README.md"), "cuda", monkeypatch)
    check_vllm(run, "cuda", monkeypatch)
    for added in ("--no-async-scheduling", "--enforce-eager"):
        with pytest.raises(FtkitError, match=added):
            check_vllm(run.without(flag=added), "cuda", monkeypatch)


def test_a_misspelled_variable_is_caught():
    line = ServeLine("x", "cpu", "vllm", [], {"VLLM_USE_V2_MODEL_RUNER": "0",
                                               "HCCL_ASYNC_ERROR_HANDLING": "0"})
    assert unknown_variables(line) == ["VLLM_USE_V2_MODEL_RUNER"]


def test_a_table_key_that_is_no_setting_is_caught():
    text = "| Key | Default | Meaning |\n| --- | --- | --- |\n| `enabled` | x | y |\n| `retries` | x | y |\n"
    assert table_keys(text) == ["enabled", "retries"]
    assert not set(table_keys(text)) <= {f.name for f in fields(RecoveryConfig)}


def test_an_unmarked_serve_block_is_reported(tmp_path):
    page = tmp_path / "page.md"
    for command, marker in (("vllm serve MODEL", "vllm"), ("ftkit serve MODEL", "ftkit"),
                            (f"python -m {launch.SERVER_MODULE} --model MODEL", "vllm")):
        page.write_text(f"Text\n\n```sh\n{command} --no-async-scheduling\n```\n")
        with pytest.raises(AssertionError, match=f"{marker}-serve: PLATFORM"):
            documented_lines([page])
    page.write_text("<!-- vllm-serve: any -->\n```sh\nvllm serve MODEL\n```\n")
    with pytest.raises(AssertionError, match=r"PLATFORM one of cpu, cuda, ascend(?!, any)"):
        documented_lines([page])
    page.write_text("<!-- vllm-serve: cpu -->\n```sh\nX=1 vllm serve MODEL\n```\n"
                    "<!-- ftkit-serve: any -->\n```sh\nftkit serve MODEL -tp 2\n```\n")
    assert [(x.kind, x.platform, x.argv, x.env) for x in documented_lines([page])] == [
        ("vllm", "cpu", ["MODEL"], {"X": "1"}), ("ftkit", "any", ["MODEL", "-tp", "2"], {})]
