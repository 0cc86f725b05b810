"""``ftkit serve`` as a user runs it: the command and environment it would run (``--dry-run``),
every refusal with its message and exit status 2, and its handling of ``VLLM_PLUGINS``.

The platform is vLLM's own detection (CPU here) unless a test says it is another one.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ftkit.serve import launch
from ftkit.vllm import platform as vllm_platform
from ftkit.vllm.environment import cpu_threads_bind, engine_environment
from ftkit_cli.main import ftkit

RECOVERY = json.dumps({"fault_tolerance": {"enabled": True}})
SECRET = "a-secret-of-24-characters"
#: What every test starts from: none of the variables ftkit serve reads or sets.
CLEAN = {name: None for name in ("VLLM_PLUGINS", "VLLM_CPU_KVCACHE_SPACE",
                                 "VLLM_USE_V2_MODEL_RUNNER", "VLLM_CPU_ATTN_SPLIT_KV", "TORCH_COMPILE_DISABLE",
                                 "VLLM_CPU_OMP_THREADS_BIND",
                                 "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "FTKIT_INJECT_SECRET",
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                 "HCCL_ASYNC_ERROR_HANDLING")}


def serve(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(ftkit, ["serve", *args], env={**CLEAN, **(env or {})})


def dry_run(*args: str, env: dict[str, str | None] | None = None
            ) -> tuple[dict[str, str], list[str], str]:
    """(the environment shown, the command, stderr) of ``ftkit serve --dry-run ARGS``."""
    result = serve("--dry-run", *args, env=env)
    assert result.exit_code == 0, result.output
    *exports, command = result.stdout.strip().splitlines()
    shown = {}
    for line in exports:
        word, assignment = shlex.split(line)
        assert word == "export"
        name, value = assignment.split("=", 1)
        shown[name] = value
    return shown, shlex.split(command), result.stderr


def refused(*args: str, env: dict[str, str | None] | None = None) -> str:
    """The message of a refused ``ftkit serve ARGS`` (exit status 2, no traceback)."""
    result = serve("--dry-run", *args, env=env)
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    return result.stderr


@pytest.fixture
def on_platform(monkeypatch):
    """Make vLLM's detection answer another platform."""
    def use(device_type: str) -> None:
        monkeypatch.setattr(vllm_platform, "current_device_type", lambda: device_type)
    return use


def fake_distribution(root: Path, name: str, entry_points: dict[str, dict[str, str]]) -> None:
    """An installed distribution ``name`` with ``entry_points``, where ``importlib.metadata``
    finds it once ``root`` is on ``sys.path``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) + "\n"
        for group, names in entry_points.items()))


# --- the command and its environment ---------------------------------------------------------

def test_dry_run_shows_the_module_command_and_the_engine_environment():
    shown, command, stderr = dry_run("MODEL", "--tensor-parallel-size", "2", "--port", "8123",
                                     "--additional-config", RECOVERY)
    assert command == [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", "MODEL", "--tensor-parallel-size", "2", "--port", "8123",
                       "--additional-config", RECOVERY, "--no-async-scheduling",
                       "--enforce-eager"]
    assert shown["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert shown["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    assert shown["TORCH_COMPILE_DISABLE"] == "1"  # the CPU build (vLLM's compiled helpers)
    assert shown["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert shown["VLLM_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(2, os.sched_getaffinity(0))
    # The default recovery bounds need 660 s for a step; vLLM gives 300 unless told.
    assert shown["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "660"
    assert shown["VLLM_PLUGINS"].split(",")[-1] == "ftkit"
    assert "ftkit serve: added --no-async-scheduling" in stderr
    assert "ftkit serve: added --enforce-eager" in stderr
    assert "set VLLM_PLUGINS=" in stderr and "VLLM_USE_V2_MODEL_RUNNER=0" in stderr


def test_without_dry_run_it_becomes_the_server(monkeypatch):
    """No child process: ftkit serve replaces itself with the command --dry-run shows."""
    calls = []

    class Replaced(Exception):
        pass

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise Replaced

    args = ("MODEL", "-tp", "2", "--additional-config", RECOVERY)
    shown, command, _ = dry_run(*args)
    monkeypatch.setattr(os, "execve", execve)
    result = serve(*args)
    assert isinstance(result.exception, Replaced)
    [(path, argv, env)] = calls
    assert path == sys.executable and argv == command
    assert {k: env[k] for k in shown} == shown
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment goes along
    # A temporary folder of the server's own, in the one it would have had; with no server
    # started (here, the replacement failed), it is removed at once.
    own = env["TMPDIR"]
    assert os.path.dirname(own) == tempfile.gettempdir()
    assert os.path.basename(own).startswith("ftkit-serve-") and not os.path.exists(own)


def test_values_already_in_the_environment_are_kept():
    shown, _, stderr = dry_run("MODEL", "-tp", "2", "--additional-config", RECOVERY, env={
        "VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1000"})
    assert shown["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert shown["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert shown["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "1000"
    assert "VLLM_CPU_KVCACHE_SPACE=" not in stderr and "nobind" not in stderr


def test_one_rank_on_cpu_gets_no_thread_binding_execute_timeout_or_eager_mode():
    # vLLM bounds no step of a one-rank engine (its executor runs in the engine core), and
    # its compiled model has no collective to be stopped in.
    shown, command, _ = dry_run("MODEL", "--additional-config", RECOVERY)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in shown
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in shown
    assert "--enforce-eager" not in command
    dry_run("MODEL", "--no-enforce-eager", "--additional-config", RECOVERY)


def test_no_async_scheduling_given_is_not_added_again():
    _, command, stderr = dry_run("MODEL", "--no-async-scheduling", "--additional-config",
                                 RECOVERY)
    assert command.count("--no-async-scheduling") == 1
    assert "added --no-async-scheduling" not in stderr


def test_without_fault_tolerance_nothing_is_added_to_the_options():
    _, command, stderr = dry_run("MODEL", "--port", "8123")
    assert command[3:] == ["--model", "MODEL", "--port", "8123"]
    assert "added" not in stderr


@pytest.mark.parametrize("form", [
    ["--additional-config", RECOVERY],
    [f"--additional-config={RECOVERY}"],
    ["--additional_config", RECOVERY],
    ["--additional-config.fault_tolerance.enabled", "true"],
    ["--additional-config.fault_tolerance.enabled=true"],
])
def test_every_spelling_of_additional_config_is_read(form):
    _, command, _ = dry_run("MODEL", *form)
    assert command[-1] == "--no-async-scheduling"


def test_a_config_file_is_read_as_vllm_reads_it(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("additional-config:\n  fault_tolerance:\n    enabled: true\n")
    _, command, _ = dry_run("MODEL", "--config", str(config))
    assert command[-3:] == ["--config", str(config), "--no-async-scheduling"]
    config.write_text("async-scheduling: true\n"
                      "additional-config:\n  fault_tolerance:\n    enabled: true\n")
    assert "--async-scheduling: ftkit's recovery does not support" in refused(
        "MODEL", "--config", str(config))
    # The command line wins over the file, as in vLLM.
    dry_run("MODEL", "--config", str(config), "--no-async-scheduling")


def test_on_cuda_eager_mode_and_nccl_error_handling_are_set(on_platform):
    on_platform("cuda")
    shown, command, stderr = dry_run("MODEL", "-tp", "2", "--additional-config", RECOVERY)
    assert command[-2:] == ["--no-async-scheduling", "--enforce-eager"]
    assert "added --enforce-eager" in stderr
    assert shown["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in shown
    assert shown["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_on_cuda_one_rank_gets_eager_mode_too(on_platform):
    on_platform("cuda")
    _, command, _ = dry_run("MODEL", "--additional-config", RECOVERY)
    assert command[-1] == "--enforce-eager"
    assert "--no-enforce-eager: ftkit's recovery does not support a compiled model" in refused(
        "MODEL", "--no-enforce-eager", "--additional-config", RECOVERY)


def test_on_ascend_hccl_error_handling_is_set(on_platform):
    on_platform("npu")
    shown, command, _ = dry_run("MODEL", "-tp", "2", "--additional-config", RECOVERY)
    assert shown["HCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert command[-1] == "--enforce-eager" and "VLLM_CPU_OMP_THREADS_BIND" not in shown
    _, command, _ = dry_run("MODEL", "--additional-config", RECOVERY)
    assert "--enforce-eager" not in command


def test_the_threads_binding_is_the_one_ftkits_engines_get():
    """One function decides it for both (``cpu_threads_bind``)."""
    assert cpu_threads_bind(2, {3, 1}) == "1|3"
    assert cpu_threads_bind(3, {0, 1}) == "0|1|0"
    assert cpu_threads_bind(2, set()) == "nobind"
    saved = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        with engine_environment(tp=2, multiprocess=True):
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(
                2, os.sched_getaffinity(0))
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("options,named", [
    (["--async-scheduling"], "--async-scheduling"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["-pp", "2"], "--pipeline-parallel-size 2"),
    (["--enable-expert-parallel"], "--enable-expert-parallel"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "--speculative-config"),
    (["--speculative-config.method", "ngram"], "--speculative-config"),
    (["--spec-method", "ngram"], "--spec-method"),
    (["-tp", "2", "--no-enforce-eager"], "--no-enforce-eager"),
])
def test_what_recovery_cannot_roll_back_is_refused(options, named):
    message = refused("MODEL", *options, "--additional-config", RECOVERY)
    assert message.startswith(f"{named}: ftkit's recovery does not support")
    assert '"enabled": false' in message  # the other way out
    # With recovery off, ftkit has nothing to refuse.
    off = json.dumps({"fault_tolerance": {"enabled": False}})
    assert serve("--dry-run", "MODEL", *options, "--additional-config", off).exit_code == 0


def moe_model(tmp_path: Path, key: str = "num_local_experts") -> str:
    """A model folder whose configuration names experts (only its config.json is read)."""
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"],
                                                    key: 4}))
    return str(folder)


@pytest.mark.parametrize("options", [["--data-parallel-size=2"], ["-dp", "4"]])
@pytest.mark.parametrize("key", ["num_local_experts", "num_experts", "n_routed_experts"])
def test_data_parallelism_of_an_moe_model_is_refused(tmp_path, options, key):
    """Its replicas are coupled (every step together); a dense model's are not."""
    model = moe_model(tmp_path, key)
    message = refused(model, *options, "--additional-config", RECOVERY)
    size = options[-1].split("=")[-1]
    assert message.startswith(f"--data-parallel-size {size}: ftkit's recovery does not "
                              f"support data parallelism of an MoE model")


def test_a_dense_model_is_served_with_data_parallelism_each_rank_on_a_core(tmp_path):
    """Independent replicas, one engine each: every rank of every replica gets a core of its
    own (vLLM gives replica i the i-th tp entries of the binding)."""
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                   "num_experts": None}))
    for model in (str(dense), "org/some-hub-model"):  # (a hub model is checked at its start)
        shown, command, _ = dry_run(model, "-dp", "2", "--additional-config", RECOVERY)
        assert "-dp" in command
        assert shown["VLLM_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(
            2, os.sched_getaffinity(0))
    shown, _, _ = dry_run(str(dense), "-dp", "2", "-tp", "2", "--additional-config", RECOVERY)
    assert shown["VLLM_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(4, os.sched_getaffinity(0))


def test_every_refusal_is_listed_at_once():
    message = refused("MODEL", "--async-scheduling", "-pp", "2", "--additional-config",
                      RECOVERY)
    assert [line.split(":")[0] for line in message.splitlines()] == [
        "--async-scheduling", "--pipeline-parallel-size 2"]


def test_the_last_async_scheduling_flag_wins_as_in_vllm():
    dry_run("MODEL", "--async-scheduling", "--no-async-scheduling", "--additional-config",
            RECOVERY)
    refused("MODEL", "--no-async-scheduling", "--async-scheduling", "--additional-config",
            RECOVERY)


@pytest.mark.parametrize("config,expected", [
    ('{"fault_tolerance": {"enabled": true, "max_reinferense": 3}}',
     "unknown key(s) max_reinferense"),
    ('{"fault_tolerance": {"enabled": "yes"}}', "fault_tolerance.enabled must be true or false"),
    ('{"fault_tolerance": {"enabled": true, "max_reinference": -1}}',
     "max_reinference must be an integer >= 0"),
    ('{"fault_tolerance": [1]}', "must be a mapping"),
    ('{"fault_tolerance": {"enabled": true}', "not valid JSON"),
    ('["fault_tolerance"]', "must be a JSON object"),
])
def test_bad_recovery_settings_name_the_option(config, expected):
    message = refused("MODEL", "--additional-config", config)
    assert message.startswith("--additional-config: ")
    assert expected in message


def test_a_bad_dotted_setting_is_caught_too():
    message = refused("MODEL", "--additional-config.fault_tolerance.enabeld", "true")
    assert "unknown key(s) enabeld" in message


@pytest.mark.parametrize("secret,state", [(None, "is not set"), ("short", "has 5 characters")])
def test_injection_needs_a_secret_of_16_characters(secret, state):
    config = json.dumps({"fault_tolerance": {"enabled": True, "injection": True}})
    message = refused("MODEL", "--additional-config", config,
                      env={"FTKIT_INJECT_SECRET": secret})
    assert "FTKIT_INJECT_SECRET" in message and "at least 16 characters" in message
    assert state in message


def test_with_its_secret_injection_starts_and_the_secret_is_not_shown():
    config = json.dumps({"fault_tolerance": {"enabled": True, "injection": True}})
    result = serve("--dry-run", "MODEL", "--additional-config", config,
                   env={"FTKIT_INJECT_SECRET": SECRET})
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output


def test_usage_mistakes_exit_2():
    assert serve().exit_code == 2  # no model
    assert serve("--port", "8000", "MODEL").exit_code == 2  # an option before the model
    assert "give the model once" in refused("MODEL", "--model", "OTHER")
    assert "--tensor-parallel-size two: must be a whole number" in refused(
        "MODEL", "--tensor-parallel-size", "two")
    assert "--additional-config: give it a value" in refused("MODEL", "--additional-config")
    assert "--config x.json: vLLM reads only .yaml" in refused("MODEL", "--config", "x.json")


# --- VLLM_PLUGINS -----------------------------------------------------------------------------

def installed_plugin_names() -> list[str]:
    """Read here independently of ftkit: every entry point of the groups vLLM filters."""
    return [ep.name for group in ("vllm.general_plugins", "vllm.platform_plugins",
                                  "vllm.stat_logger_plugins", "vllm.io_processor_plugins")
            for ep in metadata.entry_points(group=group)]


def test_unset_it_is_set_to_every_installed_plugin_and_ftkit(tmp_path, monkeypatch):
    # A platform plugin (as vllm-ascend's "ascend") and a stat logger of another package: vLLM
    # loads them while VLLM_PLUGINS is unset, and must go on loading them.
    fake_distribution(tmp_path, "npu_platform", {
        "vllm.platform_plugins": {"fake_npu": "npu_platform:register"},
        "vllm.stat_logger_plugins": {"fake_logger": "npu_platform:Logger"},
        "vllm.endpoint_plugins": {"other_routes": "npu_platform:routes"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    shown, _, stderr = dry_run("MODEL", "--additional-config", RECOVERY)
    names = shown["VLLM_PLUGINS"].split(",")
    assert set(names) == {*installed_plugin_names(), "ftkit"}
    assert {"fake_npu", "fake_logger", "ftkit"} <= set(names)
    # Endpoint plugins loaded none before: another package's routes stay off.
    assert "other_routes" not in names
    assert len(names) == len(set(names))
    assert f"set VLLM_PLUGINS={shown['VLLM_PLUGINS']}" in stderr


def test_unset_it_is_set_even_without_recovery():
    shown, _, _ = dry_run("MODEL")
    assert "ftkit" in shown["VLLM_PLUGINS"].split(",")


def test_set_without_ftkit_while_fault_tolerance_is_given_is_an_error():
    message = refused("MODEL", "--additional-config", RECOVERY, env={"VLLM_PLUGINS": "ascend"})
    assert "VLLM_PLUGINS=ascend does not name ftkit" in message
    assert "VLLM_PLUGINS=ascend,ftkit" in message  # the fix
    # The same with recovery off: the settings would still be read by nobody.
    off = json.dumps({"fault_tolerance": {"enabled": False}})
    refused("MODEL", "--additional-config", off, env={"VLLM_PLUGINS": "ascend"})


def test_set_without_ftkit_and_without_fault_tolerance_is_left_alone():
    shown, _, stderr = dry_run("MODEL", env={"VLLM_PLUGINS": "ascend"})
    assert shown["VLLM_PLUGINS"] == "ascend"
    assert "VLLM_PLUGINS" not in stderr


def test_set_with_ftkit_is_kept_as_it_is():
    shown, _, stderr = dry_run("MODEL", "--additional-config", RECOVERY,
                               env={"VLLM_PLUGINS": "ascend,ftkit"})
    assert shown["VLLM_PLUGINS"] == "ascend,ftkit"
    assert "set VLLM_PLUGINS" not in stderr


def test_vllm_reads_names_without_stripping_them():
    """``VLLM_PLUGINS="ascend, ftkit"`` names " ftkit", which is not ftkit (vLLM splits on
    commas only)."""
    assert launch.allowed_plugins({"VLLM_PLUGINS": "ascend, ftkit"}) == ["ascend", " ftkit"]
    assert "does not name ftkit" in refused("MODEL", "--additional-config", RECOVERY,
                                            env={"VLLM_PLUGINS": "ascend, ftkit"})
