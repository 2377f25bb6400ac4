"""Elastic replicas (torchft membership): argument checks, the plan every member derives alike, and real
runs of separate replica processes over an in-process Lighthouse on a free port, with replicas killed
(SIGKILL) in the inner phase and in the middle of an exchange, and a replica restarted.

The multi-process runs are ``examples/elastic/replica.py`` subprocesses (each its own Trainer), each in its
own session with a time limit; a failing test kills their process groups.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from lightning_loco import DiLoCoStrategy, GASLoCStrategy, NoLoCoStrategy

torchft = pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")

ROOT = Path(__file__).resolve().parents[1]
REPLICA = ROOT / "examples" / "elastic" / "replica.py"


# ---------------------------------------------------------------- arguments, checked when the strategy is built


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(lighthouse="nohost"), ["lighthouse='nohost'", "HOST:PORT"]),
        (dict(lighthouse="h:99999"), ["lighthouse='h:99999'"]),
        (dict(lighthouse="h:1", outer_step_timeout=0), ["outer_step_timeout", "default 120"]),
        (dict(lighthouse="h:1", join_timeout=-1), ["join_timeout", "default 600"]),
        (dict(lighthouse="h:1", membership_every=0), ["membership_every", "default 1"]),
        (dict(lighthouse="h:1", replica_id=""), ["replica_id=''"]),
        (dict(lighthouse="h:1", overlap_steps=1), ["overlap_steps=1", "overlap_steps=0"]),
        (dict(lighthouse="h:1", ranks_per_replica=2), ["ranks_per_replica=2"]),
    ],
)
def test_bad_elastic_arguments_fail_when_built(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        NoLoCoStrategy(sync_every=4, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_elastic_refuses_diloco_and_exponential_gossip() -> None:
    with pytest.raises(ValueError, match="DiLoCoStrategy"):
        DiLoCoStrategy(lighthouse="h:1")
    with pytest.raises(ValueError, match="topology='exponential'"):
        GASLoCStrategy(lighthouse="h:1", topology="exponential")


def test_static_launch_stays_the_default() -> None:
    strategy = NoLoCoStrategy(sync_every=4)
    assert strategy.elastic is None
    built = NoLoCoStrategy(sync_every=4, lighthouse="127.0.0.1:1", replica_id="a", membership_every=3)
    assert (built.elastic.url, built.elastic.replica_id, built.elastic.membership_every) == ("http://127.0.0.1:1", "a", 3)


def test_without_torchft_the_error_names_the_extra() -> None:
    # A fresh interpreter where importing torchft fails: the package imports, elastic arguments name the extra.
    code = (
        "import sys; sys.modules['torchft'] = None\n"
        "import lightning_loco\n"
        "from lightning_loco import NoLoCoStrategy\n"
        "NoLoCoStrategy(sync_every=4)\n"
        "try:\n"
        "    NoLoCoStrategy(sync_every=4, lighthouse='127.0.0.1:1')\n"
        "except ImportError as err:\n"
        "    print('ERR', err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERR" in proc.stdout and "lightning-loco[elastic]" in proc.stdout


# ---------------------------------------------------------------- the plan: derived alike by every participant


@dataclass
class Member:
    replica_id: str
    step: int
    data: Optional[dict[str, Any]]
    store_address: str = "h:1"


@dataclass
class Quorum:
    quorum_id: int
    participants: list[Member]


def test_plan_for_a_fresh_start_a_joiner_and_a_replica_that_fell_behind() -> None:
    from lightning_loco.elastic.membership import View, make_plan

    fresh = Quorum(1, [Member(r, 0, {"current": False}) for r in ("b", "a", "c")])
    plan = make_plan(fresh, every=2, previous=None)
    assert (plan.members, plan.switch, plan.joiners, plan.donor, plan.reuse) == (("a", "b", "c"), 0, (), None, False)

    previous = View(quorum_id=1, members=("a", "b", "c"), rank=0, first_round=0, pg=object())
    same = Quorum(1, [Member(r, 6, {"current": True, "view": 1, "ok": True}) for r in ("a", "b", "c")])
    plan = make_plan(same, every=2, previous=previous)
    assert (plan.switch, plan.joiners, plan.reuse) == (8, (), True)  # nothing changed: keep the group

    failed = Quorum(1, [Member(r, 6, {"current": True, "view": 1, "ok": r != "b"}) for r in ("a", "b", "c")])
    assert not make_plan(failed, every=2, previous=previous).reuse  # a member saw an exchange fail: new group

    joined = Quorum(2, [Member("a", 6, {"current": True, "view": 1, "ok": True}),
                        Member("d", 0, {"current": False, "view": -1}),
                        Member("c", 4, {"current": True, "view": 1, "ok": True})])
    plan = make_plan(joined, every=2, previous=previous)
    # d is starting and c fell behind (it missed a membership): both heal from a at outer step 8
    assert (plan.members, plan.switch, plan.joiners, plan.donor, plan.reuse) == (("a", "c", "d"), 8, ("c", "d"), "a", False)
    assert plan.store_address.startswith("h:1/") and "q2" in plan.store_address
