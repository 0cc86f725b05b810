"""Every ``vllm serve`` line the documentation gives is accepted by vLLM's own ``vllm serve``
parser and by ftkit's supported-configuration check (``check_supported``) on its platform.

A documented line is a fenced code block right after a ``<!-- vllm-serve: PLATFORM -->``
comment (invisible once rendered), PLATFORM one of ``cpu``, ``cuda``, ``ascend``; every block in
README.md and docs/ that runs ``vllm serve`` must carry one, so no line escapes the test. In the
block, ``export NAME=VALUE`` lines and ``NAME=VALUE`` words before ``vllm serve`` set the
environment the line runs with.

The arguments go through the parser ``vllm serve`` builds (``ServeSubcommand.subparser_init``,
that is ``make_arg_parser`` on a ``FlexibleArgumentParser``), its own validation, and
``AsyncEngineArgs.from_cli_args``, as ``vllm serve`` does; the ``fault_tolerance`` settings must
be valid ftkit settings that turn recovery on. Then the configuration the model runner would
have goes through ``check_supported``:

* CPU: vLLM's real configuration (``create_engine_config``) with the embedded tiny model in
  place of the documented model, under the line's environment;
* CUDA and Ascend (no GPU or NPU here): the engine arguments with vLLM 0.32's defaults for what
  they leave unset, as ``vllm/config/vllm.py`` decides them on a GPU: asynchronous scheduling on,
  the V2 model runner unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise, CUDA graphs unless
  ``--enforce-eager``. vllm-ascend follows the same variable and scheduling default.

The negative cases drop one setting from a documented line and expect the refusal that names it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import envs
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ftkit.config import CONFIG_KEY, RecoveryConfig
from ftkit.errors import FtkitError
from ftkit.model import resolve_model
from ftkit.vllm.runner_state import check_supported

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLATFORMS = ("cpu", "cuda", "ascend")
MARKER = re.compile(r"<!--\s*vllm-serve:\s*(\w+)\s*-->")
FENCE = re.compile(r"^(```|~~~)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class ServeLine:
    where: str
    platform: str | None
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def without(self, *, flag: str | None = None, variable: str | None = None) -> ServeLine:
        assert flag is None or flag in self.argv, f"{self.where} has no {flag}"
        assert variable is None or variable in self.env, f"{self.where} does not set {variable}"
        return ServeLine(self.where, self.platform, [a for a in self.argv if a != flag],
                         {k: v for k, v in self.env.items() if k != variable})


def fenced_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line number, marker platform or None, body) of every fenced block in ``text``."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            start = index
            index += 1
            while index < len(lines) and not FENCE.match(lines[index]):
                index += 1
            previous = lines[start - 1] if start else ""
            marker = MARKER.search(previous)
            blocks.append((start + 1, marker.group(1) if marker else None,
                           "\n".join(lines[start + 1:index])))
        index += 1
    return blocks


def serve_command(body: str, where: str) -> ServeLine | None:
    """The one ``vllm serve`` command of a block, with its environment; ``None`` if none."""
    if "vllm serve" not in body:
        return None
    env: dict[str, str] = {}
    found: list[ServeLine] = []
    for command in body.replace("\\\n", " ").splitlines():
        if not command.lstrip().startswith("export ") and "vllm serve" not in command:
            continue
        words = shlex.split(command, comments=True)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
            continue
        inline = {}
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            inline[name] = value
        if words[:2] == ["vllm", "serve"]:
            found.append(ServeLine(where, None, words[2:], {**env, **inline}))
    assert len(found) <= 1, f"{where}: one vllm serve command per block"
    return found[0] if found else None


def documented_lines(paths: list[Path] = DOCUMENTS) -> list[ServeLine]:
    lines = []
    for path in paths:
        for number, platform, body in fenced_blocks(path.read_text()):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
            line = serve_command(body, where)
            if line is None:
                continue
            assert platform in PLATFORMS, (
                f"{where}: a vllm serve block needs a <!-- vllm-serve: PLATFORM --> line right "
                f"before it, PLATFORM one of {', '.join(PLATFORMS)}")
            line.platform = platform
            lines.append(line)
    return lines


LINES = documented_lines()


def documented(platform: str, document: str = "README.md") -> ServeLine:
    [line] = [x for x in LINES if x.platform == platform and x.where.startswith(document + ":")]
    return line


# --- vLLM's parser, then ftkit's check -------------------------------------------------------

def parse(line: ServeLine) -> AsyncEngineArgs:
    """What ``vllm serve`` makes of the line's arguments (``SystemExit`` on a bad one)."""
    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *line.argv])
    command.validate(args)
    if args.model_tag is not None:
        args.model = args.model_tag
    return AsyncEngineArgs.from_cli_args(args)


class V2ModelRunner:
    """vLLM's V2 runner as ``check_supported`` sees it: no V1 batch bookkeeping."""


V2ModelRunner.__name__ = V2ModelRunner.__qualname__ = "GPUModelRunner"
V2ModelRunner.__module__ = "vllm.v1.worker.gpu.model_runner"


def runner(*, v2: bool, async_scheduling: bool, device: Any, cudagraph_mode: CUDAGraphMode,
           pipeline_parallel_size: int, speculative_config: Any) -> Any:
    """The attributes ``check_supported`` reads of the model runner vLLM would build."""
    state = V2ModelRunner() if v2 else SimpleNamespace(input_batch=object(), requests={})
    state.use_async_scheduling = async_scheduling
    state.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
    state.parallel_config = SimpleNamespace(pipeline_parallel_size=pipeline_parallel_size)
    state.speculative_config = speculative_config
    state.device = device
    state.compilation_config = SimpleNamespace(cudagraph_mode=cudagraph_mode)
    return state


def cpu_runner(engine: AsyncEngineArgs) -> Any:
    engine.model = engine.tokenizer = str(resolve_model("tiny"))
    config = engine.create_engine_config()
    return runner(v2=config.use_v2_model_runner,
                  async_scheduling=bool(config.scheduler_config.async_scheduling),
                  device=torch.device("cpu"),
                  cudagraph_mode=config.compilation_config.cudagraph_mode,
                  pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
                  speculative_config=config.speculative_config)


def accelerator_runner(engine: AsyncEngineArgs, platform: str) -> Any:
    # vLLM's own reading of the variable ("0", "false", "1", ...); unset means the V2 runner
    # on a GPU with Triton (VllmConfig.use_v2_model_runner).
    v2 = envs.VLLM_USE_V2_MODEL_RUNNER
    device = torch.device("cuda", 0) if platform == "cuda" else SimpleNamespace(type="npu")
    return runner(
        v2=True if v2 is None else bool(v2),
        # Unset: on, where nothing rules it out (VllmConfig, "Enable async scheduling unless
        # there is an incompatible option").
        async_scheduling=True if engine.async_scheduling is None else engine.async_scheduling,
        device=device,
        cudagraph_mode=(CUDAGraphMode.NONE if engine.enforce_eager
                        else CUDAGraphMode.FULL_AND_PIECEWISE),
        pipeline_parallel_size=engine.pipeline_parallel_size,
        speculative_config=engine.speculative_config)


def check(line: ServeLine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raises ``FtkitError`` where ftkit would refuse the line at start."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    for name, value in line.env.items():
        monkeypatch.setenv(name, value)
    engine = parse(line)
    settings = RecoveryConfig.from_mapping(engine.additional_config[CONFIG_KEY])
    assert settings.enabled, f"{line.where}: recovery is not turned on"
    model_runner = (cpu_runner(engine) if line.platform == "cpu"
                    else accelerator_runner(engine, line.platform))
    check_supported(model_runner)


# --- the documented lines --------------------------------------------------------------------

def test_the_readme_documents_a_line_for_every_platform():
    assert sorted(x.platform for x in LINES if x.where.startswith("README.md:")) \
        == sorted(PLATFORMS)


@pytest.mark.parametrize("line", LINES, ids=lambda x: f"{x.platform}-{x.where}")
def test_every_documented_line_is_accepted(line, monkeypatch):
    check(line, monkeypatch)


@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_without_no_async_scheduling_the_line_is_refused(platform, monkeypatch):
    line = documented(platform).without(flag="--no-async-scheduling")
    with pytest.raises(FtkitError, match="--no-async-scheduling"):
        check(line, monkeypatch)


@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_without_the_v1_runner_the_line_is_refused(platform, monkeypatch):
    line = documented(platform).without(variable="VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(FtkitError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check(line, monkeypatch)


def test_on_cuda_without_enforce_eager_the_line_is_refused(monkeypatch):
    line = documented("cuda").without(flag="--enforce-eager")
    with pytest.raises(FtkitError, match="--enforce-eager"):
        check(line, monkeypatch)


def test_a_flag_vllm_does_not_know_is_caught_by_its_parser(monkeypatch):
    line = documented("cpu")
    wrong = ServeLine(line.where, "cpu", [*line.argv, "--no-such-flag"], line.env)
    with pytest.raises(SystemExit):
        check(wrong, monkeypatch)


def test_an_unmarked_serve_block_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text\n\n```sh\nvllm serve MODEL --no-async-scheduling\n```\n")
    with pytest.raises(AssertionError, match="vllm-serve: PLATFORM"):
        documented_lines([page])
    page.write_text("<!-- vllm-serve: cpu -->\n```sh\nvllm serve MODEL\n```\n")
    assert [(x.platform, x.argv) for x in documented_lines([page])] == [("cpu", ["MODEL"])]
