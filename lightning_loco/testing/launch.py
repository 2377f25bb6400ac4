"""One way to start ranks and replicas for tests, benchmarks and examples.

* :func:`free_port`: a port the kernel says is free (port 0), never a fixed one;
* :func:`init_gloo`: joins a gloo process group, through a ``FileStore`` file (no port at all) or a
  TCP port on localhost, with a short timeout so that a hang fails fast;
* :func:`strategy_class`: a strategy's class by its ``Trainer(strategy=...)`` name, from Lightning's
  own registry (where ``import lightning_loco`` registers ours), not from a map of our own.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Optional, Union


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free on ``host`` (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_gloo(
    rank: int,
    world_size: int,
    *,
    port: Optional[int] = None,
    file: Optional[Union[str, Path]] = None,
    timeout_s: float = 30.0,
) -> None:
    """Joins a gloo process group of ``world_size`` ranks as ``rank``.

    Rendezvous through ``file`` (a path every rank shares, which must not exist before the first
    rank starts: a ``FileStore``) or through ``port`` on localhost (``MASTER_ADDR``/``MASTER_PORT``
    are set for the libraries that read them). ``timeout_s`` bounds every collective."""
    import torch.distributed as dist

    if (port is None) == (file is None):
        raise ValueError("init_gloo needs exactly one of port= or file=")
    timeout = timedelta(seconds=timeout_s)
    if file is not None:
        dist.init_process_group("gloo", init_method=f"file://{Path(file).resolve()}", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)


def strategy_class(name: str) -> type:
    """The strategy class registered under ``name`` in Lightning's ``StrategyRegistry`` (ours after
    ``import lightning_loco``). Raises ``ValueError`` naming the registered names."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_loco  # noqa: F401  (registers noloco, gasloc, diloco)

    if name not in StrategyRegistry:
        raise ValueError(f"No strategy is registered as {name!r}; registered: {sorted(StrategyRegistry)}")
    return StrategyRegistry[name]["strategy"]
