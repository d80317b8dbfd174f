"""A worker process that ends when its parent, the test process, is gone.

Kept out of ``worker.py`` so that a stack dump of a worker (``pool.py`` cuts each thread's
frames at the worker loop) can tell the watcher's thread apart and leave it out.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["PARENT_POLL_S", "exit_with_parent"]

#: How often the watcher looks whether the test process is still there, in seconds.
PARENT_POLL_S = 0.5


def exit_with_parent() -> None:
    """Start a daemon thread that ends this process once its parent has died.

    When the parent dies the worker is re-parented, so its parent id changes; polling that is
    portable (Linux and macOS) and, unlike ``PR_SET_PDEATHSIG``, not tied to the thread that
    spawned the worker.
    """
    parent = os.getppid()

    def _watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=_watch_parent, name="exit-with-parent", daemon=True).start()
