"""The launcher side of ``robust run``: what runs in the agent process, beside the ranks, never in them.

- :mod:`.agent`: the elastic agent, which starts, stops and restarts the ranks of one node (a
  subclass of torch elastic's ``LocalElasticAgent``; ``robust_plugins.patches.torch_elastic``
  checks the private methods it overrides before it starts);
- :mod:`.monitor`: the node monitor, which reads the ranks' step signals and judges faults;
- :mod:`.nodes`, :mod:`.jobfaults`, :mod:`.jobfaults_sync`: what the agents of a multi-node job
  agree on (blamed and excluded nodes, the job-wide fault view);
- :mod:`.standby`: warm standby processes that become ranks at a restart.

The ranks talk to this package only through the wire names and formats of
``robust_plugins.watchdog`` (``protocol``, ``ring``, ``faults``); no in-rank module imports it
(an import-linter contract in ``pyproject.toml``).
"""
