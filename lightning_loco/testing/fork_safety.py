"""When a fork of this process is unsafe: :func:`fork_hazards` (read by
:func:`lightning_loco.testing.launch.run_module_forked` and ``benchmarks.common.forking``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["fork_hazards"]


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
