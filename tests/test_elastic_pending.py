"""An elastic round in flight when training stops, over the in-process process group of tests/elastic_fakes.py:
``abandon(timeout)`` gives the exchange that long, no less and not much more, then drops it."""

from __future__ import annotations

import threading
import time

import torch

from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.transport import ElasticTransport
from lightning_loco.transport.base import RoundId

from elastic_fakes import FakeMembership, Hub, Script

GROUP_TIMEOUT = 30.0  # the fake group's: a wait on the exchange itself would take this long


def pair(hub: Hub) -> tuple[ElasticTransport, ElasticTransport]:
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    built = []
    for rid in "ab":
        config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=rid)
        transport = ElasticTransport(config, membership=FakeMembership(hub, rid, script))
        transport.membership.at_switch(0, dict, lambda state, healed: 0)
        built.append(transport)
    return built[0], built[1]


def test_abandon_waits_up_to_its_timeout_for_a_partner_that_comes():
    hub = Hub(timeout=GROUP_TIMEOUT)
    a, b = pair(hub)
    pending = a.start_group_sum(torch.ones(4), [0, 1], round_id=RoundId(0))
    later = threading.Timer(0.3, lambda: b.start_group_sum(torch.full((4,), 2.0), [0, 1], round_id=RoundId(0)))
    later.start()
    started = time.perf_counter()
    try:
        assert pending.abandon(timeout=20.0)  # b posts 0.3 s later, well within the 20 s given
        assert time.perf_counter() - started < 10.0
        assert pending.works == []  # dropped all the same
    finally:
        later.join()
        hub.kill("b")


def test_abandon_gives_up_at_its_timeout_not_at_the_groups():
    hub = Hub(timeout=GROUP_TIMEOUT)
    a, _ = pair(hub)
    pending = a.start_group_sum(torch.ones(4), [0, 1], round_id=RoundId(0))
    started = time.perf_counter()
    try:
        assert not pending.abandon(timeout=0.5)  # b never posts
        elapsed = time.perf_counter() - started
        assert 0.5 <= elapsed < 10.0, elapsed
        assert pending.works == []
    finally:
        hub.kill("b")  # ends the thread still waiting on the exchange


def test_abandon_of_a_round_with_nobody_to_meet_or_a_dead_partner_answers_at_once():
    hub = Hub(timeout=GROUP_TIMEOUT)
    a, b = pair(hub)
    hub.kill("b")
    landed = b.start_group_sum(torch.ones(4), [1], round_id=RoundId(0))  # a group of one: nothing to send
    failed = a.start_group_sum(torch.ones(4), [0, 1], round_id=RoundId(0))  # its partner died
    started = time.perf_counter()
    assert landed.abandon(timeout=5.0)
    assert not failed.abandon(timeout=5.0)  # it ended, but failed: not finished
    assert time.perf_counter() - started < 2.0
