"""The suite's order across pytest-xdist's workers: the long tests first and spread evenly.

xdist's ``worksteal`` scheduler hands each worker one contiguous block of the collected tests (equal counts)
and later moves the tail half of the longest queue to an idle worker. Left in file order, the blocks hold very
different amounts of work (the benchmarks' smoke runs sit together), and a worker still running a long test at
the end holds up the run while the other cores idle. So the tests that took 4 s or more in a measured run
(``tests/durations.json``, written by ``scripts/test_durations.py``) are dealt longest first to the block with
the least work so far, each block starting with its long tests; the short tests fill the blocks to equal counts
in their file order, where stealing takes them. Tests that share a module-scoped fixture stay together (one
set-up). Without xdist workers the order is the files' own.

Every test also leaves torch.distributed's rendezvous variables as it found them: Lightning's launchers put
``MASTER_ADDR``/``MASTER_PORT`` into the process that launches (an in-process ``fit`` with ``spawn`` or
``fork``), and every process a later test starts from that worker would inherit the port: three replicas
started together then all bind it (``EADDRINUSE``), and their peers wait.

Where Lightning chooses the rendezvous port itself (no ``MASTER_PORT`` set), it binds port 0 and releases
it: a port of the kernel's ephemeral range, which the next outgoing connection of any process (gloo opens
many, in parallel tests) may take before the rank that listens on it binds it again. In the workers, and the
ranks they fork, Lightning draws its port as :func:`lightning_loco.testing.launch.free_port` does, below that
range; a test that starts a new interpreter running one Lightning launch gives it ``MASTER_PORT``
(``tiny.lightning_env``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning  # noqa: F401  # see below
import lightning.fabric.plugins.environments.lightning as lightning_environment
import pytest

from lightning_loco.testing.launch import free_port

# pytest-xdist's controller rebuilds each warning a worker reports by importing the module of its category,
# in that worker's own receiving thread: two of Lightning's warnings arriving at once from two workers made two
# threads import Lightning for the first time together, and its circular imports deadlocked (the controller
# stopped with _DeadlockError on lightning.pytorch.strategies). Imported here once, before any worker starts.

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID")
lightning_environment.find_free_network_port = free_port


DURATIONS = Path(__file__).with_name("durations.json")
SHORT_S = 0.2  # what a test not in durations.json is taken to cost


@pytest.fixture(autouse=True)
def _rendezvous_variables_stay_as_they_were() -> Any:
    before = {name: os.environ.get(name) for name in RENDEZVOUS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _workers(config: pytest.Config) -> int:
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in the workers, which collect the order used
    if count:
        return int(count)
    value = config.getoption("numprocesses", default=None)
    return value if isinstance(value, int) else 0


def _shares_module_fixture(item: Any) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    return any(d and d[-1].scope == "module" for d in defs.values())


def _units(items: list[Any]) -> list[list[Any]]:
    """Consecutive tests of one module that share a module-scoped fixture form one unit; every other test
    is a unit of its own."""
    units: list[list[Any]] = []
    for item in items:
        if (units and _shares_module_fixture(item) and _shares_module_fixture(units[-1][-1])
                and item.module is units[-1][-1].module):
            units[-1].append(item)
        else:
            units.append([item])
    return units


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    workers = _workers(config)
    if workers < 2 or not DURATIONS.exists():
        return
    seconds = json.loads(DURATIONS.read_text())
    units = _units(items)
    cost = [sum(seconds.get(item.nodeid, SHORT_S) for item in unit) for unit in units]
    long = sorted((k for k, unit in enumerate(units) if any(i.nodeid in seconds for i in unit)), key=lambda k: -cost[k])
    blocks: list[list[int]] = [[] for _ in range(workers)]
    work = [0.0] * workers
    for k in long:
        b = min(range(workers), key=lambda j: work[j])
        blocks[b].append(k)
        work[b] += cost[k]
    size = [sum(len(units[k]) for k in block) for block in blocks]
    dealt = set(long)
    for k in (k for k in range(len(units)) if k not in dealt):
        b = min(range(workers), key=lambda j: size[j])
        blocks[b].append(k)
        size[b] += len(units[k])
    items[:] = [item for block in blocks for k in block for item in units[k]]
