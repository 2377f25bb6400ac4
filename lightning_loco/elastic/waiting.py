"""The main thread's waits of an elastic replica, taken in short slices so that signal handlers run.

A call into torchft's client or a store (a quorum, a ``get``) holds the thread that makes it until its own
timeout; a Python signal handler (the Lightning strategy's, on SIGTERM) runs only in the main thread,
between bytecodes. So such calls run in daemon threads (:func:`in_thread`), and the main thread waits for
them in slices (:func:`wait_in_slices`), calling ``check_stop`` after each: it may raise to stop the wait.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

WAIT_SLICE_S = 0.2  # the main thread's waits are cut into slices this long
GRACE_S = 10.0  # beyond the timeouts of the calls a background thread makes, before the main thread gives up


def no_stop(waiting_for: str) -> None:
    """The default ``check_stop``: nothing stops a wait but its end or its timeout."""


def wait_in_slices(thread: threading.Thread, timeout: float, check_stop: Callable[[str], None],
                   waiting_for: str) -> bool:
    """Waits up to ``timeout`` seconds for ``thread``, in slices of ``WAIT_SLICE_S`` with
    ``check_stop(waiting_for)`` after each (it may raise to stop the wait: a signal handler has run by
    then). Returns whether the thread ended."""
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        thread.join(min(WAIT_SLICE_S, left))
        check_stop(waiting_for)
    return True


def in_thread(call: Callable[[], Any], name: str) -> tuple[threading.Thread, dict[str, Any]]:
    """Runs ``call`` in a daemon thread; the returned dict gets its ``result`` or ``error``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as err:  # handed to the waiting thread
            box["error"] = err

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box
