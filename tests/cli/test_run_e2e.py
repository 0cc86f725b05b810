"""``ftkit run`` end to end, as a user runs it: a real process, real engines, real files.

Every command runs with a unique tag in its environment, inherited by every process below
it; after each test no tagged process may be alive (the engine host, the engine core and the
workers are all ftkit's to reap, also on timeout, Ctrl-C and SIGKILL of ``ftkit`` itself), and
nothing new may be left in shared memory or the temporary folder (the hosts' folders, vLLM's
file stores and communicator segments), also when an engine was killed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
FTKIT = [sys.executable, "-c", "from ftkit_cli.main import main; main()"]
#: ``ftkit`` as a terminal's foreground job runs it: Ctrl-C raises KeyboardInterrupt. A job
#: started in the background of a non-interactive shell (a CI runner may start the suite so)
#: inherits SIGINT ignored, and Python leaves an ignored SIGINT ignored.
FTKIT_AT_A_TERMINAL = [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, "
                       "signal.default_int_handler); from ftkit_cli.main import main; main()"]

TP1_OOM = """\
name: oom_decode
engine: {tensor_parallel_size: 1}
workload:
  prompts: ["the quick brown fox", "one two three four five"]
  max_tokens: 24
faults:
  - {kind: oom, rank: 0, at: {request: 1, token: 6}, phase: forward, times: 2}
expect: {outcome: recovered, tokens: identical, timeout_s: 240}
"""

TP1_EXHAUSTED = """\
name: oom_exhausted
workload:
  prompts: ["the quick brown fox", "one two three four five"]
  max_tokens: 24
recovery: {max_reinference: 1}
faults:
  - {kind: oom, rank: 0, at: {request: 0, token: 10}, phase: sample, times: 2}
expect: {outcome: failed, tokens: prefix, timeout_s: 240}
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ftkit-cache")


def tagged_env(cache_dir: Path) -> tuple[dict[str, str], str]:
    tag = uuid.uuid4().hex
    env = dict(os.environ, FTKIT_CACHE_DIR=str(cache_dir), FTKIT_TEST_TAG=tag, COLUMNS="160")
    return env, tag


def tagged_processes(tag: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("FTKIT_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def leftover_files() -> set[str]:
    """What ftkit's engines and hosts could leave: shared memory segments, the hosts' and
    engines' folders and vLLM's file stores in the temporary folder (the suite runs one test
    at a time, so anything new is this test's)."""
    shm = {f"/dev/shm/{n}" for n in os.listdir("/dev/shm")} if os.path.isdir("/dev/shm") \
        else set()
    tmp = tempfile.gettempdir()
    return shm | {os.path.join(tmp, n) for n in os.listdir(tmp)
                  if n.startswith(("ftkit-host-", "ftkit-engine-", "vllm_dist_"))}


def held_by_others(tag: str) -> set[str]:
    """The shared memory segments that live processes not of this test map (engines that
    other test runs on the machine have running): not this test's to find removed."""
    held = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("FTKIT_TEST_TAG") == tag:
                continue
            with open(f"/proc/{p.pid}/maps") as maps:
                held.update(line.split(maxsplit=5)[5].strip() for line in maps
                            if "/dev/shm/" in line)
        except (psutil.Error, OSError, IndexError):
            continue
    return held


def new_leftovers(before: set[str], tag: str) -> set[str]:
    return leftover_files() - before - held_by_others(tag)


def run_ftkit(args: list[str], cache_dir: Path, timeout: float = 600,
              extra_env: dict[str, str] | None = None):
    env, tag = tagged_env(cache_dir)
    env.update(extra_env or {})
    before = leftover_files()
    proc = subprocess.run(FTKIT + args, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert tagged_processes(tag) == [], "ftkit left processes behind"
    # Resource trackers of exited processes unlink their semaphores a moment later.
    deadline = time.monotonic() + 5
    while leftover_files() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_files() - before == set(), "ftkit left files behind"
    return proc


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_run_recovers_and_reports_pass(tmp_path, cache_dir):
    scenario = write(tmp_path, "oom.yaml", TP1_OOM)
    report = tmp_path / "report.json"
    proc = run_ftkit(["run", str(scenario), "--json", str(report)], cache_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    data = json.loads(report.read_text())
    (sc,) = data["scenarios"]
    assert sc["verdict"] == "pass"
    assert sc["faults"][0]["fired"] and sc["faults"][0]["attempts"] == 2
    assert sc["faults"][0]["fired_at"] == {"request": 1, "token": 6, "step": sc["faults"][0]["fired_at"]["step"]}
    assert sc["faults"][0]["recovered"]
    assert all(r["first_divergence"] is None and r["expected"] == r["actual"] for r in sc["requests"])
    assert all(len(r["actual"]) == 24 for r in sc["requests"])
    assert not sc["baseline_from_cache"]

    # The second run takes the fault-free tokens from the cache.
    again = run_ftkit(["run", str(scenario), "--json", str(report)], cache_dir)
    assert again.returncode == 0
    assert json.loads(report.read_text())["scenarios"][0]["baseline_from_cache"]


@pytest.mark.exhaustive
def test_expected_failure_passes_when_the_engine_fails_cleanly(tmp_path, cache_dir):
    scenario = write(tmp_path, "exhausted.yaml", TP1_EXHAUSTED)
    report = tmp_path / "report.json"
    proc = run_ftkit(["run", str(scenario), "--json", str(report)], cache_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sc,) = json.loads(report.read_text())["scenarios"]
    assert sc["verdict"] == "pass"
    assert "max_reinference is 1" in sc["error"]
    assert sc["faults"][0]["attempts"] == 2 and not sc["faults"][0]["recovered"]


#: A step whose request gets its second KV block (prompt of 18 tokens, blocks of 32): re-run
#: without rolling ``_update_states`` back, the block is appended twice and the request's KV
#: goes astray once it needs a third block.
TP1_NEW_BLOCK = """\
name: oom_new_block
workload:
  prompts: ["the quick brown fox jumps over the lazy dog", "one two three four five"]
  max_tokens: 88
faults:
  - {kind: oom, rank: 0, at: {request: 0, token: 15}, phase: forward}
expect: {outcome: recovered, tokens: identical, timeout_s: 240}
"""

#: Loaded by every Python process of the run (``sitecustomize`` on ``PYTHONPATH``): ftkit's
#: rollback of a failed step switched off in the engine host that runs the engine.
NO_ROLLBACK = """\
from ftkit.vllm import runner_state
runner_state.V1RunnerState.rollback_execute = lambda self, scheduler_output: None
"""


# In the fast tier: test_explore_e2e's rollback campaign and its run of the shrunk file.
@pytest.mark.exhaustive
def test_a_crippled_engine_gets_verdict_fail_with_its_first_divergence(tmp_path, cache_dir):
    scenario = write(tmp_path, "new_block.yaml", TP1_NEW_BLOCK)
    patch = tmp_path / "cripple"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(NO_ROLLBACK)
    report = tmp_path / "report.json"
    proc = run_ftkit(["run", str(scenario), "--json", str(report)], cache_dir,
                     extra_env={"PYTHONPATH": str(patch)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (sc,) = json.loads(report.read_text())["scenarios"]
    assert sc["verdict"] == "fail" and sc["faults"][0]["fired"], sc["reason"]
    # The damage is silent and late: request 0 matches up to the faulted step, then differs.
    mismatch = sc["first_mismatch"]
    assert mismatch["request"] == 0 and mismatch["position"] > 15, mismatch
    assert f"FAIL oom_new_block: {sc['reason']}" in proc.stdout.replace("\n", " ") \
        or sc["reason"] in proc.stdout


#: The bundled library (``scenarios/*.yaml``) in parts, each run by one ``ftkit run``: the
#: exhaustive tier's shards take each part on its own.
LIBRARY_PARTS = {
    "tp1": ["chunked_prefill_preemption", "determinism", "device_reset_exhausted",
            "logit_bias_prompt_logprobs", "oom_sampling", "penalties_sample_fault",
            "process_kill_resume_chunked", "process_kill_resume_features",
            "process_kill_unprotected", "stop_strings_n2", "uce_activation", "uce_weights"],
    "tp2": ["compound_seeded", "device_reset", "hang", "link_break", "link_flap",
            "link_flap_exhausted", "process_kill", "uce_kv"],
    "pipeline_and_serve": ["pipeline_process_kill", "pipeline_stage0", "pipeline_stage1",
                           "serve_data_parallel", "serve_link_flap", "serve_process_kill"],
}


def test_the_library_parts_hold_every_bundled_scenario_once():
    names = [name for part in LIBRARY_PARTS.values() for name in part]
    assert sorted(names) == sorted(p.stem for p in (ROOT / "scenarios").glob("*.yaml"))


@pytest.mark.exhaustive(alone=True)
@pytest.mark.parametrize("part", sorted(LIBRARY_PARTS))
def test_bundled_scenario_library_passes(tmp_path, part):
    """The headline scenario and the rest of scenarios/ pass, as `make run` shows, a part at
    a time."""
    report = tmp_path / "report.json"
    files = [str(ROOT / "scenarios" / f"{name}.yaml") for name in LIBRARY_PARTS[part]]
    proc = run_ftkit(["run", *files, "--json", str(report)], tmp_path / "cache",
                     timeout=800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scenarios = {sc["name"]: sc for sc in json.loads(report.read_text())["scenarios"]}
    assert set(scenarios) == set(LIBRARY_PARTS[part])
    assert {sc["verdict"] for sc in scenarios.values()} == {"pass"}
    LIBRARY_CHECKS.get(part, lambda scenarios, stderr: None)(scenarios, proc.stderr)


def _tp2_part(scenarios: dict, stderr: str) -> None:
    flap = scenarios["link_flap"]
    assert flap["faults"][0]["kind"] == "link_flap" and flap["faults"][0]["attempts"] == 3
    assert flap["reinferences"] == 3
    assert sum(len(r["actual"]) for r in flap["requests"]) == flap["tokens_compared"] >= 256
    # The progress log (stderr) says when a killed engine was replaced and its requests
    # resumed.
    assert re.search(r"process_kill: recovered: engine replaced [0-9.]+ s after it died; "
                     r"[1-9][0-9]* request\(s\) resumed", stderr), stderr[-3000:]
    exhausted = scenarios["link_flap_exhausted"]
    assert "max_reinference is 3" in exhausted["error"]
    assert exhausted["faults"][0]["attempts"] == 4


def _pipeline_and_serve_part(scenarios: dict, stderr: str) -> None:
    # A worker of a live server killed mid-stream: the server replaced its engine (the
    # restart the runner gave it) and every stream went on, with no client error.
    served = scenarios["serve_process_kill"]
    [kill] = served["faults"]
    assert kill["fired"] and kill["recovered"] and kill["restart_s"] > 0
    assert served["client"]["failed_requests"] == 0 and len(served["client"]["run"]) == 5
    # Two data-parallel replicas: the reset recovered in the replica that met it (one round,
    # one rank), the kill by an engine replacement; the crippled variant is
    # tests/serve/test_serve_dp_scenario.py.
    replicas = scenarios["serve_data_parallel"]
    reset, kill = replicas["faults"]
    assert (reset["kind"], reset["fired"], reset["recovered"]) == ("device_reset", True, True)
    assert (kill["kind"], kill["fired"], kill["recovered"]) == ("process_kill", True, True)
    [round_] = replicas["recoveries"]
    assert (round_["decision"], len(round_["ranks"])) == ("recompute", 1)
    assert all(len(r["actual"]) == 48 for r in replicas["requests"])
    assert replicas["client"]["failed_requests"] == 0


#: What each part checks besides every verdict being pass.
LIBRARY_CHECKS = {"tp2": _tp2_part, "pipeline_and_serve": _pipeline_and_serve_part}


@pytest.mark.exhaustive
def test_timeout_stops_the_run_and_reaps_every_process(tmp_path, cache_dir):
    slow = TP1_OOM.replace("tensor_parallel_size: 1", "tensor_parallel_size: 2").replace(
        "kind: oom", "kind: link_break").replace("timeout_s: 240", "timeout_s: 15")
    scenario = write(tmp_path, "slow.yaml", slow)
    started = time.monotonic()
    proc = run_ftkit(["run", str(scenario)], cache_dir)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ERROR" in proc.stdout and "timed out" in proc.stdout
    # The scenario's timeout_s (15 s) bounds its run: that bound, with generous slack for
    # ftkit's own start and the kill on a loaded machine.
    assert time.monotonic() - started < 15 + 105


def test_ctrl_c_ends_a_tp2_run_within_10_s_and_leaves_nothing(tmp_path, cache_dir):
    """Ctrl-C at a terminal (SIGINT to ``ftkit``'s process group; its engine hosts have
    sessions of their own) while a tensor parallel 2 engine generates: ``ftkit`` ends within
    10 s of the signal with exit 130 and says so, and nothing of its engines stays."""
    scenario = write(tmp_path, "tp2.yaml", TP1_OOM.replace(
        "tensor_parallel_size: 1", "tensor_parallel_size: 2").replace("max_tokens: 24",
                                                                      "max_tokens: 1200"))
    env, tag = tagged_env(cache_dir / f"fresh-{uuid.uuid4().hex}")  # no cached baseline
    # A temporary folder of its own (other runs on the machine may have folders of theirs),
    # short: vLLM's IPC socket paths in it must fit in 107 characters.
    own_tmp = Path(tempfile.mkdtemp(prefix="e2e-"))
    env["TMPDIR"] = str(own_tmp)
    before = leftover_files()
    proc = subprocess.Popen(FTKIT_AT_A_TERMINAL + ["run", str(scenario)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        shown = []
        # Progress lines (not a terminal): wait until the engine under test generates, past
        # its recovered fault (its 2 x 1200 tokens take seconds more), not the baseline's.
        for line in proc.stderr:
            shown.append(line)
            if "recovered: step" in line or time.monotonic() > deadline:
                break
        assert "recovered: step" in line, "".join(shown)
        os.killpg(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        out, err = proc.communicate(timeout=60)
        ended_s = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, out + err
    assert "interrupted" in (out + err).lower()
    # The documented bound (docs/architecture.md: within 10 s of a Ctrl-C), with generous
    # slack for a loaded machine.
    assert ended_s < 10 + 20, f"ftkit took {ended_s:.1f} s to end after Ctrl-C"
    assert tagged_processes(tag) == []
    # Resource trackers of exited processes unlink their semaphores a moment later.
    while (new_leftovers(before, tag) or len(os.listdir(own_tmp)) > 1) \
            and time.monotonic() - interrupted < 10:
        time.sleep(0.2)
    # (torch's compiled-kernel cache is shared by every engine and kept by design.)
    left = [n for n in os.listdir(own_tmp) if not n.startswith("torchinductor_")]
    shutil.rmtree(own_tmp, ignore_errors=True)
    assert left == [], "ftkit left folders behind"
    # Named semaphores (sem.*, 32 bytes each) are left out: a host killed mid-job takes its
    # resource tracker, which would unlink them, with it (an open point).
    shm = {p for p in new_leftovers(before, tag)
           if p.startswith("/dev/shm/") and not p.startswith("/dev/shm/sem.")}
    assert shm == set(), "ftkit left shared memory behind"


@pytest.mark.exhaustive  # a SIGKILLed owner in the fast tier: test_owner_killed
def test_sigkill_of_ftkit_leaves_no_process_and_no_file_behind(tmp_path, cache_dir):
    """``ftkit`` killed with SIGKILL runs no clean-up: its engine host sees its input end,
    closes the engine (a plain vLLM engine at TP 2, the baseline's), removes what the
    engine's processes held in shared memory and the front end's folder for it, and exits."""
    scenario = write(tmp_path, "tp2.yaml", TP1_OOM.replace(
        "tensor_parallel_size: 1", "tensor_parallel_size: 2").replace("max_tokens: 24",
                                                                      "max_tokens: 200"))
    env, tag = tagged_env(cache_dir / f"fresh-{uuid.uuid4().hex}")  # no cached baseline
    before = leftover_files()
    proc = subprocess.Popen(FTKIT + ["run", str(scenario)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stderr:  # progress lines (not a terminal): wait for a live engine
            if "engine ready" in line or time.monotonic() > deadline:
                break
        assert "engine ready" in line, "the engine did not start"
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()
        while time.monotonic() - killed < 15 and (
                tagged_processes(tag) or leftover_files() - before):
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert tagged_processes(tag) == [], "processes outlived ftkit by 15 s"
    assert leftover_files() - before == set(), "files outlived ftkit by 15 s"


def test_malformed_scenario_exits_2_with_file_line_and_field(tmp_path, cache_dir):
    bad = write(tmp_path, "bad.yaml", TP1_OOM.replace("times: 2", "times: two"))
    proc = run_ftkit(["run", str(bad)], cache_dir, timeout=60)
    assert proc.returncode == 2
    assert f"{bad}:7: faults[0].times:" in proc.stderr
    assert "Traceback" not in proc.stderr
