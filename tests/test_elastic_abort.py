"""A failure closes the membership's group for every member at once, over torchft's real gloo group.

Three forked processes hold one membership: r2 dies (``os._exit``, no goodbye) while r0's round with it is
posted; r0 takes that round alone and aborts the group. Its next round's partner, r1, does not know and
posts to r0 afterwards: it must fail on the closed connection, not wait for the group's timeout. gloo
keeps a group's connections open while any of its works is referenced, so this holds only if nothing of
the failed round (its works, or errors holding their frames) outlives the abort.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from lightning_loco.elastic.config import ElasticConfig
from lightning_loco.elastic.membership import Membership
from lightning_loco.elastic.plan import View
from lightning_loco.elastic.transport import ElasticTransport

IDS = ("r0", "r1", "r2")
TIMEOUT_S = 60  # the group's: a wait that ran into it would say "Timed out"


class FixedMembership:
    """One membership over a real torchft group that never changes; ``failed`` is the real one (aborts)."""

    failed = Membership.failed
    sync = False

    def __init__(self, pg: Any, rank: int) -> None:
        self.view = View(1, IDS, rank, 0, pg)

    def close(self) -> None:
        pass


def _member(rank: int, address: str, conn: Any) -> None:
    try:
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S))
        pg.configure(f"{address}/pg", IDS[rank], rank, len(IDS))
        config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=IDS[rank], outer_step_timeout=TIMEOUT_S)
        transport = ElasticTransport(config, membership=FixedMembership(pg, rank))
        payload = torch.full((1000,), float(rank))
        if rank == 2:
            time.sleep(1.0)  # r0's round with it is posted by now
            os._exit(0)
        if rank == 0:
            transport.outer_step = 0
            first = transport.start_group_sum(payload, (0, 2))  # r2 dies with this round posted
            first.wait()
            transport.outer_step = 1
            second = transport.start_group_sum(payload, (0, 1))  # the group is closed: alone, nothing posted
            second.wait()
            conn.send(("r0", first.alone, second.alone, [f["peers"] for f in transport.failures]))
            time.sleep(TIMEOUT_S + 5)  # alive: its connections close by the abort, not by its exit
        else:
            time.sleep(2.5)  # r0 has failed and aborted by now
            transport.outer_step = 1
            pending = transport.start_group_sum(payload, (0, 1))
            pending.wait()
            conn.send(("r1", pending.alone, [f["error"] for f in transport.failures]))
    except BaseException as err:  # noqa: BLE001  (reported to the test)
        conn.send(("crashed", repr(err)))
    finally:
        conn.close()
        os._exit(0)


def test_a_member_that_posts_to_a_replica_that_aborted_fails_at_once() -> None:
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=TIMEOUT_S))
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in IDS]
    procs = [ctx.Process(target=_member, args=(r, f"127.0.0.1:{store.port}", pipes[r][1]), daemon=True)
             for r in range(len(IDS))]
    for proc in procs:
        proc.start()
    for _, sending in pipes:
        sending.close()
    try:
        got = [pipes[r][0].recv() if pipes[r][0].poll(2 * TIMEOUT_S) else ("silent",) for r in (0, 1)]
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    assert got[0] == ("r0", True, True, [["r2"]]), got
    label, alone, errors = got[1]
    assert label == "r1" and alone and len(errors) == 1, got
    said = errors[0].lower()
    assert "timed out" not in said and ("closed" in said or "reset" in said), errors  # the abort reached it
