"""examples/ascend/serve.sh builds the ``vllm serve`` command docs/ascend.md describes: the
arguments parse with this vLLM's own parser, the ``fault_tolerance`` settings are valid ftkit
settings, and ``ftkit doctor`` gates the start. ``vllm`` and ``ftkit`` are stand-ins on PATH
that record how they were called (no NPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ftkit.config import CONFIG_KEY, RecoveryConfig

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ascend" / "serve.sh"


def recorder(directory: Path, name: str, exit_code: int = 0) -> None:
    path = directory / name
    path.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env python3
        import json, os, sys
        with open(os.path.join({str(directory)!r}, "{name}.calls"), "a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
        sys.exit({exit_code})
        """))
    path.chmod(0o755)


def calls(directory: Path, name: str) -> list[dict]:
    path = directory / f"{name}.calls"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def serve(tmp_path: Path, *args: str, doctor_exit: int = 0, **env: str
          ) -> subprocess.CompletedProcess[str]:
    recorder(tmp_path, "vllm")
    recorder(tmp_path, "ftkit", doctor_exit)
    environment = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                   "ASCEND_SET_ENV": str(tmp_path / "no-cann-here.sh"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=environment, capture_output=True,
                          text=True, timeout=60)


def test_the_script_serves_with_recovery_on_and_the_settings_recovery_needs(tmp_path):
    result = serve(tmp_path, "/models/m", "4", "--max-model-len", "4096",
                   FTKIT_MAX_REINFERENCE="5", FTKIT_EVENT_LOG_DIR="/var/log/ftkit")
    assert result.returncode == 0, result.stderr
    assert [c["argv"] for c in calls(tmp_path, "ftkit")] == [["doctor", "--expect-platform",
                                                              "npu"]]
    [call] = calls(tmp_path, "vllm")
    assert call["argv"][:2] == ["serve", "/models/m"]
    assert call["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert call["env"]["HCCL_ASYNC_ERROR_HANDLING"] == "0"
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(call["argv"][2:])
    assert args.tensor_parallel_size == 4
    assert args.async_scheduling is False
    assert args.max_model_len == 4096  # further arguments are passed on
    settings = RecoveryConfig.from_mapping(args.additional_config[CONFIG_KEY])
    assert settings == RecoveryConfig(enabled=True, max_reinference=5, round_timeout_s=30,
                                      event_log_dir="/var/log/ftkit")


def test_the_defaults_and_the_doctor_gate(tmp_path):
    result = serve(tmp_path, "/models/m")
    assert result.returncode == 0, result.stderr
    [call] = calls(tmp_path, "vllm")
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(call["argv"][2:])
    assert args.tensor_parallel_size == 2
    assert RecoveryConfig.from_mapping(args.additional_config[CONFIG_KEY]) == RecoveryConfig(
        enabled=True)

    refused = tmp_path / "refused"
    refused.mkdir()
    result = serve(refused, "/models/m", doctor_exit=1)
    assert result.returncode == 1
    assert calls(refused, "vllm") == []  # not on NPUs: vllm serve is never started


def test_without_a_model_the_script_says_how_to_call_it(tmp_path):
    result = serve(tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_the_script_is_executable():
    assert os.access(SCRIPT, os.X_OK)
