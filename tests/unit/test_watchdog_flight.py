"""Hang localization by flight-recorder sequence numbers (what stacks cannot tell on NCCL): the
pure rule on made-up counters (the real server: tests/distributed/test_watchdog_flight_dist.py)."""

from __future__ import annotations

import os

import pytest

from robust_plugins.watchdog import detect, flight


def _pg(enq: int, done: int | None = None, started: int = -1, members=()) -> detect.GroupSeq:
    return detect.GroupSeq(members=list(members), enqueued=enq, completed=enq if done is None else done,
                           started=started)


def test_the_rank_that_issued_fewer_collectives_is_the_suspect_whatever_the_stacks_say():
    # NCCL: ranks 0-2 issued all-reduce 8 and wait for it at .item() (their stacks look like
    # compute); rank 3 never issued it. Stacks alone would see four ranks "outside a collective".
    status = {0: {"nccl:0": _pg(8, 7)}, 1: {"nccl:0": _pg(8, 7)}, 2: {"nccl:0": _pg(8, 7)}, 3: {"nccl:0": _pg(7)}}
    where = detect.localize_by_sequence(status)
    assert where.suspects == [3] and where.stuck == [3]
    assert "rank 3 issued collective 7 of group nccl:0, ranks [0, 1, 2] 8" in where.reason


def test_a_rank_behind_on_one_group_because_it_waits_in_another_is_a_victim():
    # Rank 0 is stuck computing; rank 1 (its TP peer, group 1) waits in TP collective 5 and so is
    # behind on the DP group 2, where rank 2 already issued DP collective 3.
    status = {0: {"g:0": _pg(1), "g:1": _pg(4)},
              1: {"g:0": _pg(1), "g:1": _pg(5, 4), "g:2": _pg(2)},
              2: {"g:0": _pg(1), "g:2": _pg(3, 2)}}
    where = detect.localize_by_sequence(status)
    assert where.suspects == [0]
    assert "ranks [1] lag too but wait" in where.reason


def test_equal_issue_counts_fall_back_to_started_then_to_stacks():
    same = {r: {"g:0": _pg(5, 4, started=5)} for r in range(3)}
    assert detect.localize_by_sequence(same) is None  # all entered: the hang is inside it
    same[2] = {"g:0": _pg(5, 4, started=4)}  # rank 2's device never reached the kernel
    where = detect.localize_by_sequence(same)
    assert where.suspects == [2] and "started on the device" in where.reason
    untracked = {r: {"g:0": _pg(5, 4)} for r in range(3)}  # started -1: not tracked
    assert detect.localize_by_sequence(untracked) is None


def test_unreadable_ranks_are_never_cleared_and_nothing_readable_means_no_answer():
    status = {0: {"g:0": _pg(3, 2)}, 1: {"g:0": _pg(2)}, 2: None}
    where = detect.localize_by_sequence(status)
    assert where.suspects == [1, 2] and where.stuck == [1]
    assert detect.localize_by_sequence({0: None, 1: None}) is None


@pytest.mark.timeout(60)
def test_recorder_env_sizes_the_ring_unless_the_user_chose():
    # Both names: torch 2.4-2.5 (the declared range starts at 2.4) read only the old one.
    assert flight.recorder_env({}) == {"TORCH_FR_BUFFER_SIZE": flight.BUFFER_DEFAULT,
                                       "TORCH_NCCL_TRACE_BUFFER_SIZE": flight.BUFFER_DEFAULT}
    assert flight.recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {"TORCH_FR_BUFFER_SIZE": "0"}
    assert flight.recorder_env({"TORCH_FR_BUFFER_SIZE": "100"}) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}
    assert flight.recorder_env({"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}) == {}


def test_socket_paths_fit_unix_limits(tmp_path):
    assert flight.socket_path(tmp_path, 3).endswith(f"fr-rank3-pid{os.getpid()}.sock")
    assert len(flight.socket_path("/x" * 80, 0)) <= 107  # a long run dir goes to the temp dir
    assert flight.fetch(str(tmp_path / "nobody.sock"), timeout=0.5) is None


def test_the_monitor_finds_only_the_sockets_ranks_serve_and_gloo_ranks_serve_none(tmp_path):
    live = flight.socket_path(tmp_path, 1, pid=4242)
    os.makedirs(os.path.dirname(live), exist_ok=True)
    open(live, "w").close()
    assert flight.served_paths(tmp_path, {0: 4241, 1: 4242}) == {1: live}
    assert flight.serve_if_needed(tmp_path, 0) is None  # no process group: nothing to serve
