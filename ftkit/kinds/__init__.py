"""The fault kinds: everything ftkit knows about each, registered in one place per kind.

::

    from ftkit.kinds import kind_spec, KIND_SPECS
    spec = kind_spec("link_flap")          # a FaultKind or its name
    spec.collective, spec.ends_process, spec.params, spec.rules, spec.injection

Each module of this package (except ``base``) declares ``SPECS``, a tuple of ``KindSpec``
(``ftkit.kinds.base``): its summary, whether it is implemented, whether it is collective and
whether it ends a process, its params model, its semantic rules, its injector action, its
damage assessment and its doctor row. The modules are found by walking this package, so
adding a kind is one new module here (its name also is a member of ``ftkit.faults.FaultKind``,
the vocabulary scenarios are validated against).

========================  ======================================================================
``link``                  ``link_break``, ``link_flap``
``device_reset``          ``device_reset``
``uce``                   ``uce``
``hang``                  ``hang``
``oom``                   ``oom``
``process_kill``          ``process_kill``
``ray_kill``              ``ray_worker_kill``, ``node_loss`` (vLLM's Ray executor)
========================  ======================================================================

This package imports neither the recovery engine, the injector nor vLLM, and no torch at
import time (scenario loading and the CLI import it).
"""

from __future__ import annotations

import importlib
import pkgutil

from ftkit.faults import FaultKind
from ftkit.kinds.base import KindSpec


def _discover() -> dict[FaultKind, KindSpec]:
    found: dict[FaultKind, KindSpec] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name == "base" or module.name.startswith("_"):
            continue
        for spec in importlib.import_module(f"{__name__}.{module.name}").SPECS:
            if spec.kind in found:
                raise RuntimeError(f"fault kind {spec.kind} is registered twice")
            found[spec.kind] = spec
    # In the order FaultKind declares them: listings and the doctor show them so.
    return {kind: found[kind] for kind in FaultKind if kind in found}


#: Every registered kind's spec, in ``FaultKind`` order.
KIND_SPECS: dict[FaultKind, KindSpec] = _discover()


def kind_spec(kind: FaultKind | str) -> KindSpec:
    """The spec of ``kind`` (a ``FaultKind`` or its name). ``ValueError`` for a name that is no
    ``FaultKind``, ``KeyError`` for a kind no module registers."""
    return KIND_SPECS[FaultKind(kind)]


__all__ = ["KIND_SPECS", "KindSpec", "kind_spec"]
