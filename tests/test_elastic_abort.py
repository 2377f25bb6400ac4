"""A failure closes the membership's group for every member at once, over torchft's real gloo group.

Three forked processes hold one membership: r2 dies (``os._exit``, no goodbye) while r0's round with it is
posted; r0 takes that round alone and aborts the group. Its next round's partner, r1, does not know and
posts to r0 afterwards: it must fail on the closed connection, not wait for the group's timeout. gloo
keeps a group's connections open while any of its works is referenced, so this holds only if nothing of
the failed round (its works, or errors holding their frames) outlives the abort.

The members order these events through the store (r2 dies once r0 has posted; r1 posts once r0 has
aborted), not by sleeping. They are spawned, not forked: a child forked from a test process inherits the
locks its threads held at that instant (the store's server thread among them), and one such child once
never reached the group's rendezvous.
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


def _member(rank: int, port: int, conn: Any) -> None:
    try:
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=TIMEOUT_S)
        events = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        pg = ProcessGroupGloo(timeout=timeout)
        pg.configure(f"127.0.0.1:{port}/pg", IDS[rank], rank, len(IDS))
        config = ElasticConfig(lighthouse="127.0.0.1:1", replica_id=IDS[rank], outer_step_timeout=TIMEOUT_S)
        transport = ElasticTransport(config, membership=FixedMembership(pg, rank))
        payload = torch.full((1000,), float(rank))
        if rank == 2:
            events.wait(["r0 posted"])
            os._exit(0)  # with r0's round with it posted
        if rank == 0:
            transport.outer_step = 0
            first = transport.start_group_sum(payload, (0, 2))  # r2 dies with this round posted
            events.set("r0 posted", "1")
            first.wait()
            transport.outer_step = 1
            second = transport.start_group_sum(payload, (0, 1))  # the group is closed: alone, nothing posted
            second.wait()
            events.set("r0 aborted", "1")
            conn.send(("r0", first.alone, second.alone, [f["peers"] for f in transport.failures]))
            time.sleep(TIMEOUT_S + 5)  # alive: its connections close by the abort, not by its exit
        else:
            events.wait(["r0 aborted"])
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
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in IDS]
    procs = [ctx.Process(target=_member, args=(r, store.port, pipes[r][1]), daemon=True) for r in range(len(IDS))]
    for proc in procs:
        proc.start()
    for _, sending in pipes:
        sending.close()  # a child that dies without reporting closes its pipe: EOF here

    def report(r: int, wait_s: float) -> Any:
        try:
            return pipes[r][0].recv() if pipes[r][0].poll(wait_s) else ("silent",)
        except EOFError:
            return ("exited without a report",)

    try:
        got = [report(0, 3 * TIMEOUT_S), report(1, 3 * TIMEOUT_S)]
        got.append(report(2, 0))  # r2 reports only if it crashed
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    assert got[0] == ("r0", True, True, [["r2"]]), got
    label, alone, errors = got[1]
    assert label == "r1" and alone and len(errors) == 1, got
    said = errors[0].lower()
    assert "timed out" not in said and ("closed" in said or "reset" in said), errors  # the abort reached it
