"""The multi-process tests' deadlines (``tests.support.spawn_within`` and ``run_launch``): a rank that hangs fails
the test within its time limit, and is killed; it never blocks the suite."""

from __future__ import annotations

import sys
import time

import pytest

from tests.support import run_launch, spawn_within


def _rank_one_hangs(rank: int) -> None:
    if rank == 1:
        time.sleep(600)


def _rank_one_raises(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def test_a_hung_rank_fails_the_spawn_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 3 s"):
        spawn_within(_rank_one_hangs, (), nprocs=2, timeout=3)
    assert time.monotonic() - start < 60


def test_a_failed_rank_fails_the_spawn():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        spawn_within(_rank_one_raises, (), nprocs=2, timeout=120)


def test_a_hung_launch_is_killed_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 2 s"):
        run_launch([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"], timeout=2)
    assert time.monotonic() - start < 30


def test_a_launch_that_fails_fails_the_test_with_its_output():
    with pytest.raises(AssertionError, match="failed \\(3\\)(.|\\n)*said this"):
        run_launch([sys.executable, "-c", "import sys; print('said this'); sys.exit(3)"], timeout=60)
    assert "ok" in run_launch([sys.executable, "-c", "print('ok')"], timeout=60)
