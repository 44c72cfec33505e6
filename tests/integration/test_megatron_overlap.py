"""megatron-core ``overlap_grad_reduce`` with compression: the sync really overlaps backward.

2 gloo ranks, cpu-tiny GPT, int8. Event order, not timings: at one step the sync thread is held
at the first dispatched bucket group until backward reaches the first transformer layer. Backward
can only get there if the dispatch returned without running the collective, so the event list
proves the group's compressed sync ran during backward, after its dispatch and before
``finish_grad_sync`` waited on it. The overlapped run must train bitwise as the synchronous one.
"""

from __future__ import annotations

import pytest

from _dist import run_ranks

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def _events(rank, world, steps, gate_step):
    from mcore_worker import overlap_events

    return overlap_events(rank, world, steps, gate_step)


def test_overlapped_compressed_sync_runs_during_backward_and_matches_synchronous():
    res = run_ranks(_events, 2, 140, 6, 3)
    for r in res:
        sync, over = r[False], r[True]
        assert not sync["threaded"] and over["threaded"] and over["groups"] > 1
        ev = over["events"]
        names = [e for e, _ in ev]
        assert "gate-timeout" not in names, ev
        first = next(n for e, n in ev if e == "dispatch")
        i_dispatch = ev.index(("dispatch", first))
        i_layer0 = names.index("layer0-backward")
        i_done = ev.index(("done", first))
        i_wait = ev.index(("wait", first))
        # dispatched inside backward, before layer 0's gradients existed; its collectives finished
        # only after backward went on to layer 0 (the gate), and finish_grad_sync waited after that
        assert i_dispatch < i_layer0 < i_done < i_wait < names.index("step-end"), ev
        # every group was dispatched before any wait: all of them during backward
        dispatched = [n for e, n in ev if e == "dispatch"]
        assert len(dispatched) == over["groups"] and max(
            ev.index(("dispatch", n)) for n in dispatched) < min(i for i, e in enumerate(names) if e == "wait"), ev
        # numerically the same training as the synchronous compressed path
        assert over["losses"] == sync["losses"] and over["digest"] == sync["digest"]
    assert res[0][True]["digest"] == res[1][True]["digest"]
