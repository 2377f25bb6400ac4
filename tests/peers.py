"""Two peer processes for the heal tests: spawned around a TCPStore on a port the kernel gives."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from typing import Any, Callable

import torch


def spawn_pair(peer: Callable[..., None], arg: Any) -> tuple[Any, Any]:
    """Runs ``peer(rank, store address, arg, pipe)`` in two spawned processes (not forked: see
    ``test_elastic_heal``); returns what each sent on its pipe, or ``("silent", None)`` for a process that said
    nothing within 90 s."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=peer, args=(r, f"127.0.0.1:{store.port}", arg, pipes[r][1]), daemon=True)
             for r in range(2)]
    for proc in procs:
        proc.start()
    for _, sending in pipes:
        sending.close()  # a child that dies without reporting closes the pipe: EOF here

    def result(r: int) -> Any:
        try:
            return pipes[r][0].recv() if pipes[r][0].poll(90) else ("silent", None)
        except EOFError:
            return ("silent", None)

    try:
        results = [result(0), result(1)]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return results[0], results[1]


def torchft_group(address: str, rank: int) -> tuple[Any, Any]:
    """In a peer: rank ``rank`` of a two-rank torchft gloo group and a store client, both under ``address``."""
    from torchft.process_group import ProcessGroupGloo, create_store_client

    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"{address}/pg", f"r{rank}", rank, 2)
    return pg, create_store_client(f"{address}/heal", timedelta(seconds=60))
