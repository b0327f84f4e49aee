"""The forward loop's stop paths: every way a run stops keeps the units it handed to the writers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose, small

from dspark_precompute import faults
from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import RankFailedError
from dspark_precompute.write.parallel.distributed import ERROR, Coordinator, Lockstep, Ranks
from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024", "data.max_samples=24")


def committed(tmp_path: Path) -> set[int]:
    return committed_units(CacheStore(tmp_path / "cache"))


@pytest.fixture
def fault(monkeypatch):
    def set_fault(spec: str) -> None:
        monkeypatch.setenv("DSPARK_FAULT", spec)
        faults.reload()

    yield set_fault
    monkeypatch.delenv("DSPARK_FAULT", raising=False)
    faults.reload()


def test_an_error_right_after_a_unit_is_handed_to_the_writers_still_commits_that_unit(tmp_path, fault):
    fault("unit_submitted=2:raise")
    with pytest.raises(RuntimeError, match="injected fault at unit_submitted"):
        run(compose(small(tmp_path, *UNITS)))
    assert committed(tmp_path) == {0, 1}  # the second unit was submitted, not yet committed, when it raised


def test_a_peers_failure_read_at_a_unit_boundary_commits_the_units_already_submitted(tmp_path, monkeypatch):
    calls = []

    def check(self: Coordinator) -> None:  # one copy per rank: a peer's marker shows up before the third unit
        calls.append(1)
        if len(calls) == 3:
            raise RankFailedError("rank 1 failed, so rank 0 stops too: injected")

    monkeypatch.setattr(Coordinator, "check", check)
    with pytest.raises(RankFailedError, match="rank 1 failed"):
        run(compose(small(tmp_path, *UNITS)))
    assert committed(tmp_path) == {0, 1}


def test_a_failure_in_a_unit_keeps_the_units_before_it_and_drops_only_the_one_in_flight(tmp_path, fault):
    fault("unit_start=3:raise")
    with pytest.raises(RuntimeError, match="injected fault at unit_start"):
        run(compose(small(tmp_path, *UNITS)))
    assert committed(tmp_path) == {0, 1}
    result = run(compose(small(tmp_path, *UNITS)))
    assert result.complete and result.resumed_units == 2


def test_a_disabled_lockstep_is_only_this_ranks_signal_flag_and_never_tells_anyone():
    one = Lockstep(Ranks(), enabled=True)  # one rank: nothing to agree with
    assert not one.enabled
    assert one.go(True, None) is True and one.go(False, None) is True
    assert one.go(True, 15) is False and one.halt is None
    assert one.can_tell() is False and one.tell(ERROR) is False and one.failed() == []
    with one.collective():
        assert one.inside is False


def test_a_library_callers_ctrl_c_after_a_unit_is_handed_over_still_commits_it(tmp_path, monkeypatch):
    """Without the commands' handlers, Ctrl-C is a KeyboardInterrupt from wherever the loop is: its first stop."""
    from dspark_precompute.write.store import forward

    hits = []

    def interrupt(name: str) -> None:
        if name == "unit_submitted":
            hits.append(name)
            if len(hits) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(forward, "fault_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(compose(small(tmp_path, *UNITS)))
    assert committed(tmp_path) == {0, 1}
