"""Guard for the private torch.distributed.elastic members that ``robust run``'s agent overrides.

``robust_plugins/launcher/agent.py`` subclasses torchrun's ``LocalElasticAgent`` and overrides
three private methods (``_rendezvous``, ``_start_workers``, ``_monitor_workers``), reads the
private counter ``_remaining_restarts`` and the ``WorkerGroup`` fields the rendezvous fills
(``store``, ``group_rank``, ``master_addr``, ``master_port``), for warm standbys swaps the
per-rank process factory ``get_subprocess_handler`` while ranks start, and holds the process
context's ``close`` (``_pcontext``) while it polls, for emergency saves. None of that is public API: a
torch release may rename or re-sign any of it, and an override that no longer matches would be
skipped or called wrongly without an error. This module is the check, in the style of every host
patch here (``_guard.py``): a supported version range, then the parameter names of each
overridden method and the presence of each field, raising :class:`HostVersionError` naming what
changed and the supported versions before any rank is started.

Why it lives in ``patches/``: it encodes knowledge of torch internals, and ``patches/`` is where a
reader looks for every place robust_plugins depends on a host's internals. The subclass itself
stays beside the monitor it drives (``robust_plugins/launcher/agent.py``) and calls :func:`check` first.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
from typing import Any, Callable, Iterator

from robust_plugins.errors import HostVersionError
from robust_plugins.patches import _guard, _ranges

#: torch 2.4 is the package's floor (pyproject ``torch>=2.4``); ``LocalElasticAgent`` has taken
#: ``logs_specs`` since 2.3. Below 2.15 because each release can move these private members;
#: exercised by the tests on 2.13 (CPU build) and 2.14.1 (CUDA build on CPU, ``make compat``): every
#: member below is the same in both, so no per-version branch is needed; the signature checks
#: below also run on every launch.
RANGE = _ranges.TORCH_ELASTIC
SUPPORTED = f"torch {RANGE.spec}"

#: method name -> parameter names of the torch method the agent overrides (or calls).
OVERRIDDEN = {
    "_rendezvous": ["self", "worker_group"],
    "_start_workers": ["self", "worker_group"],
    "_monitor_workers": ["self", "worker_group"],
    "_stop_workers": ["self", "worker_group"],
    "_shutdown": ["self", "death_sig", "timeout"],
}

#: Fields of ``WorkerGroup`` the agent reads or rewrites after the rendezvous.
WORKER_GROUP_FIELDS = ("spec", "workers", "store", "group_rank", "master_addr", "master_port")

#: Attributes ``SimpleElasticAgent.__init__`` sets that the agent reads.
AGENT_FIELDS = ("_remaining_restarts", "_worker_group")

#: The process context ``LocalElasticAgent`` keeps (``_pcontext``), and the parameters of its
#: ``close``, which the context's poll calls with no signal the moment one rank has failed.
PCONTEXT_FIELD = "_pcontext"
PCONTEXT_CLOSE = ["self", "death_sig", "timeout"]

#: ``torch.distributed.run`` functions ``robust run`` calls with torchrun's parsed arguments.
RUN_FUNCTIONS = {"config_from_args": ["args"], "get_args_parser": []}

#: The factory ``SubprocessContext._start`` calls (by keyword) for each rank's process; the
#: standby hand-off (:func:`subprocess_handlers`) replaces it while the agent starts ranks.
HANDLER_FACTORY = ("get_subprocess_handler",
                   ["entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options"])

#: Variables ``LocalElasticAgent._start_workers`` sets per rank and incarnation (besides the
#: ``TORCHELASTIC_*`` ones): the only ones a warm standby may see change at its hand-off.
RANK_ENV = frozenset({"RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING"})


def is_rank_env(name: str) -> bool:
    """True for a variable torch's agent sets per rank or incarnation."""
    return name in RANK_ENV or name.startswith("TORCHELASTIC_")


class StandbyHandler:
    """What ``SubprocessContext`` uses of a ``SubprocessHandler`` (``proc``, ``local_rank_id``,
    ``close``), for a rank that runs in an already started process (a session leader)."""

    def __init__(self, proc, local_rank_id: int) -> None:
        self.proc = proc
        self.local_rank_id = local_rank_id

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """Signal the rank's process group, as torch's handler does."""
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:
            pass


#: The variable torch's dynamic rendezvous reads in ``next_rendezvous`` (and ``use_agent_store``)
#: at call time: "1" builds each round's bootstrap address anew on that round's rank 0.
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def per_round_bootstrap() -> Iterator[None]:
    """Within the block (the agent's rendezvous), torch's dynamic rendezvous publishes the round's
    bootstrap address (``MASTER_ADDR``/``MASTER_PORT`` keys under the round's prefix) from that
    round's rank 0, every round.

    Why: with the shared store on (torch's default), a handler builds that address only at its
    own first rendezvous. A node that joins a later round (a hot spare, a node back after a loss)
    then waits for keys the long-running rank 0 never writes again, and the round times out
    (seen: ``wait timeout ... /torch.rendezvous.<id>.1/MASTER_ADDR``). robust run never uses that
    address (its agent hosts a fresh worker store per incarnation), so only the keys matter.
    Scoped to the rendezvous: outside it ``use_agent_store`` must stay True, since the ranks
    connect as clients to the agent's store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    before = os.environ.get(NO_SHARED_STORE)
    os.environ[NO_SHARED_STORE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NO_SHARED_STORE, None)
        else:
            os.environ[NO_SHARED_STORE] = before


def _check_bootstrap_switch() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    try:
        source = inspect.getsource(DynamicRendezvousHandler.next_rendezvous)
    except (OSError, TypeError):
        return  # no source (a frozen build): the version range above still holds
    if NO_SHARED_STORE not in source:
        import torch

        raise HostVersionError(
            f"torch {torch.__version__}: DynamicRendezvousHandler.next_rendezvous no longer reads "
            f"{NO_SHARED_STORE}, which robust run sets during its rendezvous so that nodes joining "
            f"a later round (spares) get the round's address. Supported: {SUPPORTED}.")


#: Where torch's dynamic rendezvous waits between reads of the shared round state: the module's
#: ``_delay`` (looked up at call time), called as below once a SYNC action (a node waiting for
#: others to join or leave) in ``_DistributedRendezvousOpExecutor.run``.
RDZV_POLL_CALL = "_delay(seconds=1)"


def rendezvous_poll_s(max_nodes: int) -> float:
    """Seconds between a node's reads of the rendezvous state in a job of up to ``max_nodes``
    nodes: 0.1 s up to 10 nodes, rising to torch's own 1 s at 100 nodes and beyond, so that the
    store never serves more than about 100 reads a second on a poll's account below that size
    (torch's load for every larger job)."""
    return min(1.0, max(0.1, 0.01 * max_nodes))


#: The dynamic rendezvous handler's view of the shared round state (``_state_holder``), and the
#: seconds its last read stays fresh (``_cache_duration``, 1 s in torch).
STATE_HOLDER_FIELD = "_state_holder"
STATE_CACHE_FIELD = "_cache_duration"


def shorten_state_cache(handler: Any, seconds: float) -> bool:
    """A dynamic rendezvous ``handler``'s read of the round state stays fresh ``seconds`` (torch:
    1 s), so a node waiting for a restart's round, or an agent asking whether another node waits
    (``num_nodes_waiting``, every monitor interval), sees a change within ``seconds``. False for a
    handler without that state (the static rendezvous: nothing to poll)."""
    holder = getattr(handler, STATE_HOLDER_FIELD, None)
    if holder is None:
        return False
    if not hasattr(holder, STATE_CACHE_FIELD):
        import torch

        raise HostVersionError(
            f"torch {torch.__version__}: the dynamic rendezvous' state holder has no "
            f"{STATE_CACHE_FIELD}, which robust run shortens for fast restarts. Supported: {SUPPORTED}.")
    setattr(holder, STATE_CACHE_FIELD, seconds)
    return True


@contextlib.contextmanager
def rendezvous_poll(seconds: float) -> Iterator[None]:
    """Within the block (the agent's rendezvous), torch's dynamic rendezvous reads the shared
    round state every ``seconds`` instead of every second while it waits for other nodes (with
    :func:`shorten_state_cache`, each read is a fresh one).

    Why: a restart's round needs a few such reads (leave, join, the other nodes' joins), and the
    other nodes learn that one waits through the same cached state, so the 1 s poll and the 1 s
    cache made a two-node restart's rendezvous take 1-2 s however fast the nodes were (0.2 s with
    both at 0.1 s, loopback). Only the SYNC poll changes; the random start-up skew and every
    timeout stay torch's."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous._delay

    def _delay(seconds: float | tuple[float, float]) -> None:  # noqa: F811 - torch's keyword
        original(poll if seconds == 1 else seconds)

    poll = seconds
    _delay.__wrapped__ = original
    dynamic_rendezvous._delay = _delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = original


def _check_rendezvous_poll() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    if executor is None or not callable(getattr(dynamic_rendezvous, "_delay", None)):
        import torch

        raise HostVersionError(
            f"torch {torch.__version__}: torch.distributed.elastic.rendezvous.dynamic_rendezvous no "
            f"longer has _DistributedRendezvousOpExecutor and _delay, whose poll robust run shortens "
            f"for fast restarts. Supported: {SUPPORTED}.")
    try:
        source = inspect.getsource(executor.run)
    except (OSError, TypeError):
        return  # no source (a frozen build): the version range above still holds
    _check_fields("_BackendRendezvousStateHolder", dynamic_rendezvous._BackendRendezvousStateHolder.__init__,
                  (STATE_CACHE_FIELD,))
    if RDZV_POLL_CALL not in source:
        import torch

        raise HostVersionError(
            f"torch {torch.__version__}: the dynamic rendezvous no longer polls with "
            f"{RDZV_POLL_CALL}, which robust run shortens for fast restarts. Supported: {SUPPORTED}.")


@contextlib.contextmanager
def subprocess_handlers(factory: Callable[..., Any]) -> Iterator[None]:
    """Within the block, each rank torch's elastic agent starts gets ``factory(**kwargs)`` (torch's
    own keyword arguments, :data:`HANDLER_FACTORY`), or torch's handler where it returns None."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    _guard.check_signature("torch", original, HANDLER_FACTORY[1], SUPPORTED)

    def get_subprocess_handler(**kwargs: Any):
        return factory(**kwargs) or original(**kwargs)

    get_subprocess_handler.__wrapped__ = original
    api.get_subprocess_handler = get_subprocess_handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original


@contextlib.contextmanager
def before_failure_stop(agent: Any, hold: Callable[[], None]) -> Iterator[None]:
    """Within the block (one ``_monitor_workers`` poll), ``hold()`` runs before torch stops the
    ranks because one of them exited: the poll's own ``close()``, which SIGTERMs the others.

    Why: torch stops the survivors inside the poll, before it returns a failure to the agent.
    A survivor that had not yet reached its failing collective then dies before its emergency
    save starts; ``hold`` is where the monitor waits for those saves (bounded). Only the
    poll's close is held: the agent's own stops pass a signal and go through at once."""
    pcontext = getattr(agent, PCONTEXT_FIELD, None)
    if pcontext is None:
        yield
        return
    original = pcontext.close

    def close(death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        if death_sig is None:
            hold()
        original(death_sig, timeout)

    _guard.bind_instance(pcontext, "close", close)
    try:
        yield
    finally:
        _guard.unbind_instance(pcontext, "close")


def check(torch_version: str | None = None) -> None:
    """Raise :class:`HostVersionError` unless the installed torch elastic agent has every private
    member ``robust run`` relies on, with the expected signature. ``torch_version`` overrides the
    installed version string (tests)."""
    import torch
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerGroup
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    installed = torch_version or torch.__version__
    problem = RANGE.error(installed)
    if problem is not None:
        raise HostVersionError(f"robust run's elastic agent overrides private methods of torch's "
                               f"LocalElasticAgent: {problem}")
    for name, params in OVERRIDDEN.items():
        target = getattr(LocalElasticAgent, name, None)
        if target is None:
            raise HostVersionError(
                f"torch {torch.__version__}: LocalElasticAgent.{name} no longer exists; robust run "
                f"overrides it. Supported: {SUPPORTED}."
            )
        _guard.check_signature("torch", target, params, SUPPORTED)
    for name, params in RUN_FUNCTIONS.items():
        target = getattr(torch_run, name, None)
        if target is None:
            raise HostVersionError(
                f"torch {torch.__version__}: torch.distributed.run.{name} no longer exists; robust "
                f"run parses torchrun's options with it. Supported: {SUPPORTED}."
            )
        _guard.check_signature("torch", target, params, SUPPORTED)
    # WorkerGroup fills its fields in __init__; read them from the source rather than building a
    # WorkerSpec (that needs a rendezvous handler).
    _check_fields("WorkerGroup", WorkerGroup.__init__, WORKER_GROUP_FIELDS)
    _check_fields("SimpleElasticAgent", SimpleElasticAgent.__init__, AGENT_FIELDS)
    _check_fields("LocalElasticAgent", LocalElasticAgent.__init__, (PCONTEXT_FIELD,))
    from torch.distributed.elastic.multiprocessing.api import PContext

    _guard.check_signature("torch", PContext.close, PCONTEXT_CLOSE, SUPPORTED)
    _check_bootstrap_switch()
    _check_rendezvous_poll()
    from torch.distributed.elastic.multiprocessing import api

    factory = getattr(api, HANDLER_FACTORY[0], None)
    if factory is None:
        raise HostVersionError(
            f"torch {torch.__version__}: torch.distributed.elastic.multiprocessing.api."
            f"{HANDLER_FACTORY[0]} no longer exists; robust run's standby workers replace it. "
            f"Supported: {SUPPORTED}; --no-standby runs without them."
        )
    _guard.check_signature("torch", factory, HANDLER_FACTORY[1], SUPPORTED)


def _check_fields(owner: str, init, fields: tuple[str, ...]) -> None:
    try:
        source = inspect.getsource(init)
    except (OSError, TypeError):
        return  # no source (a frozen build): the signature checks above still ran
    missing = [f for f in fields if f"self.{f} " not in source and f"self.{f}:" not in source
               and f"self.{f}=" not in source]
    if missing:
        import torch

        raise HostVersionError(
            f"torch {torch.__version__}: {owner}.__init__ no longer sets {', '.join(missing)}, which "
            f"robust run reads. Supported: {SUPPORTED}."
        )
