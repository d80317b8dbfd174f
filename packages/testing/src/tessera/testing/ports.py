"""Free TCP ports on the loopback interface for rendezvous."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    The OS picks the port (bind to 0), so parallel test sessions do not collide on a fixed
    number. There is an unavoidable window between closing the probe socket and the rendezvous
    binding it; the worker pool retries its start-up once with a new port to cover it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
