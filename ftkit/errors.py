"""The exceptions ftkit raises, in one tree.

::

    FtkitError                      anything ftkit reports to a caller
     +-- ScenarioError              a scenario file is malformed or cannot run (file, line, field)
     |    +-- ScenarioErrors        every problem of one or more files (ftkit.scenario.errors)
     +-- EngineError                the vLLM engine could not start or died
     +-- RecoveryError              the recovery engine gave up on a step (the engine sees this)
     |    +-- ReinferenceExhausted  a step failed more than ``max_reinference`` times
     |    +-- RecoveryInconsistent  the ranks' positions admit no common re-run
     +-- InjectionError             a fault could not be injected as asked
     +-- RunTimeout                 a run exceeded its ``timeout_s`` bound
     +-- EventLogError              an event-log line of another version or an unknown event
     |                              (ftkit.contracts.eventlog)
     +-- FtkitSettingError          a pytest setting or marker ftkit cannot use
                                    (ftkit.pytest_plugin)

Code chooses an error by a cause it carries, never by the text of a message: a recovery round's
``Decision.cause`` (``ftkit.recovery.coordinator.Cause``) names the class its ``raise``
surfaces as (``Decision.error``): ``REINFERENCE_EXHAUSTED`` -> ``ReinferenceExhausted``,
``OUT_OF_STEP`` -> ``RecoveryInconsistent``, every other cause -> ``RecoveryError``. An error
that is no fault ftkit handles (a bug in the model, say) reaches the engine unchanged.

The injected and simulated faults themselves (``ftkit.faults``) are *not* FtkitErrors: they
model the errors a device or a network raises, and are classified like the real ones.
"""

from __future__ import annotations


class FtkitError(Exception):
    """Base class of every error ftkit raises on purpose."""


class ScenarioError(FtkitError):
    """A scenario is malformed or asks for something that cannot run."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.field = field
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = self.file or "<scenario>"
        if self.line is not None:
            where += f":{self.line}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class EngineError(FtkitError):
    """The vLLM engine could not be started, or died while running."""


class RecoveryError(FtkitError):
    """The recovery engine could not re-run a failed step; the fault is surfaced."""


class ReinferenceExhausted(RecoveryError):
    """A step failed on more consecutive attempts than ``max_reinference`` allows."""


class RecoveryInconsistent(RecoveryError):
    """The ranks stand at positions from which no common re-run is exact."""


class InjectionError(FtkitError):
    """A fault could not be injected as the scenario asks."""


class RunTimeout(FtkitError):
    """A run went past its ``timeout_s`` bound and was stopped."""
