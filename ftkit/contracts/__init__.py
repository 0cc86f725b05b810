"""The records that cross a process boundary, each owned by one module.

Everything one ftkit process tells another goes through a typed, versioned record that
serialises itself (``to_json`` / ``from_json``); no other module builds or reads these
payloads by key strings.

========================  =====================================================================
``step``                  ``RpcKind`` and the ``StepHook`` protocol: what the step wrapper
                          (recovery half) shows the fault injector (injection half)
``plan``                  ``FaultPlan``: the faults of one run, from the scenario's
                          ``FaultSpec`` to every rank's injector (through vLLM's
                          ``collective_rpc``)
``eventlog``              the ranks' event log: ``FaultFired``, ``StepRecovered``,
                          ``RecoveryRound``, ``KvRecomputed``, ``ParamsReloaded``; one writer
                          (``EventLog``) and one reader (``read_events``)
``requests``              the ids of a run's requests (``request_id``, ``parse_request_id``):
                          how the runner names them and a worker's injector finds them
``job``                   ``EngineJob`` / ``JobResult``: what the scenario runner sends to an
                          engine host process and what it gets back
``sampling``              ``SamplingSpec``: how each request of a job is sampled (vLLM's
                          ``SamplingParams`` fields); part of the job, built by the scenario
========================  =====================================================================

This package sits below both halves of ftkit (recovery and injection) and imports neither.
"""
