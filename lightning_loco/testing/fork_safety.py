"""When a fork of this process is unsafe: :func:`fork_hazards` (read by
:func:`lightning_loco.testing.launch.run_module_forked` and ``benchmarks.common.forking``); and what keeps a
forked child from running the destructors of objects it inherited: :func:`after_fork_in_child`; and whether
:func:`~lightning_loco.testing.ranks.start_ranks` may fork here: :func:`fork_is_safe`.

A forked child inherits its parent's garbage: objects no longer referenced but not yet collected (a reference
cycle waits for the cyclic collector). When the child's collector frees one that owns threads, its destructor
runs in the child, where those threads do not exist: a gloo process group's destructor then joins its worker
threads and waits forever, or aborts with ``std::system_error: No such process``. Both were seen in the test
suite: three ranks forked from a test process that had run other tests hung in their first full collection
until stopped after 180 s; the same with an unreferenced ``ProcessGroupGloo`` reproduces it at once. So every
child forked from a process that imported this module freezes what it inherited (``gc.freeze``: the
collector never looks at those objects again, and the child frees only what it made itself).

The same hook renews torch's intra-op thread pool on the child's one thread. After a fork torch marks the pool
it inherited as corrupt and replaces it at the next ``set_num_threads``, without a lock; each new thread makes that
call on its first parallel op, so two threads starting together in a fresh child can both take the replacement
and one finds no pool (``RuntimeError: pool INTERNAL ASSERT FAILED ... ParallelOpenMP.cpp ... Invalid thread
pool!``: seen once in B5's quick run in the suite, in a pool worker whose simulator started its replicas' threads).
One ``set_num_threads`` right after the fork, before any thread starts, does the replacement alone.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from pathlib import Path

__all__ = ["after_fork_in_child", "fork_hazards", "fork_is_safe"]


def after_fork_in_child() -> None:
    """In a forked child: moves every object it inherited out of the cyclic collector's reach (``gc.freeze``),
    so that no destructor of the parent's garbage runs here, and renews torch's thread pool at its inherited
    size while the child has one thread (see the module docstring). Registered to run after
    every ``os.fork`` (multiprocessing's and Lightning's fork launchers included) once this module is imported."""
    gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None:  # its thread pool, renewed here before any thread of the child asks for it
        torch._C.set_num_threads(torch._C.get_num_threads())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)


def fork_hazards() -> list[str]:
    """The threads of this process that make a forked child unsafe: torchft's runtime ("torchft-…" threads,
    started by a ``LighthouseServer`` or a ``Manager`` in this process, and never ended). A child inherits that
    runtime's state without its threads; a torchft Manager started in it crashed (SIGSEGV) or hung. A thread is
    listed once it has first run (it names itself then), so a fork in the first moments after a server started
    can miss it. Empty where the threads cannot be listed (no ``/proc``)."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if name.startswith("torchft"))


def fork_is_safe() -> bool:
    """Whether forking this process gives children that work: ``fork`` exists here, CUDA is not
    initialised (a forked child cannot use it) and no default process group is (a child would share
    its connections). A process that has trained may also hold locks in threads a child inherits:
    pass ``start_method="spawn"`` there."""
    import torch
    import torch.distributed as dist

    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    return not torch.cuda.is_initialized() and not (dist.is_available() and dist.is_initialized())
