"""Where we reach into Lightning internals. Each use is guarded and tested against the installed version.

Lightning >= 2.5.2 broadcasts a SIGTERM flag from rank 0 on every training batch
(``_TrainingEpochLoop._broadcast_sigterm_tensor``). That blocking global collective per step is
exactly what low-communication training removes, so our strategies replace it, for the duration of
``fit``, with a check of this process's own flag. A process that receives SIGTERM still stops as
before; the others are no longer told by rank 0 (launchers such as torchrun and SLURM signal every
process anyway).
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Optional

_SIGTERM_HOOK = "_broadcast_sigterm_tensor"


def disable_per_batch_sigterm_broadcast(epoch_loop: Any) -> Optional[Callable[[], None]]:
    """Replaces the per-batch SIGTERM broadcast of ``epoch_loop`` with a local check.

    Returns a function that undoes the change, or ``None`` when this Lightning version has no such
    broadcast (nothing to remove).
    """
    if not callable(getattr(type(epoch_loop), _SIGTERM_HOOK, None)):
        return None

    def local_sigterm_check() -> None:
        trainer = getattr(epoch_loop, "trainer", None)
        if getattr(trainer, "received_sigterm", False):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()

    setattr(epoch_loop, _SIGTERM_HOOK, local_sigterm_check)

    def restore() -> None:
        epoch_loop.__dict__.pop(_SIGTERM_HOOK, None)

    return restore


_destroy_registered = False


def destroy_process_group_at_exit() -> None:
    """Destroys the default process group at interpreter exit (Lightning does this only for NCCL).

    Without it, gloo processes occasionally abort at exit (``terminate called ...``).
    """
    global _destroy_registered
    if _destroy_registered:
        return
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    atexit.register(_destroy_dist_connection)
    _destroy_registered = True
