"""A discrete-event simulator of an inference fleet behind the admission gateway.

The gateway in the simulator runs the production ``admission.decide``, the production ledger
core (``ledger.memory.LedgerCore``) and the production charge and Retry-After rules, so what a
replay shows is what ``extproc serve`` does. Modules, in the order a request meets them:

- ``workload`` (top level, ``extproc.sim.workload``): jobs from traces, JSONL, decision logs or
  synthetic generators;
- ``clients``: attempts, SDK-like retries and timeouts;
- ``policies``: none, naive, saturation, limit-N, article, default, defer, oracle;
- ``engine``: one continuous-batching replica in virtual time (batched token steps);
- ``autoscaler``: replica recommenders (HPA baseline; pluggable);
- ``run``: the event loop, the fleet and the gateway; a ``Result``;
- ``scenarios``: the reference incident, trace replays at a load, synthetic scenarios;
- ``report`` and ``replay``: tables, JSON, plots, the ``extproc replay`` command.

See ``docs/simulator.md`` for the definitions (goodput, deadline, oracle) and the results.
"""
