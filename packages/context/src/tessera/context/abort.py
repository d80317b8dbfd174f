"""Leave blocked collectives when a peer is known to be gone: abort NCCL, cut gloo's links.

A rank blocked in a collective waits for its peers until the collective's timeout. When the
heartbeats have already shown that a peer stopped (``tessera.context.failures``), waiting on is
pointless, so the survivors abort their groups and their collectives raise at once.

NCCL offers this: ``ProcessGroup.abort()`` tears its communicators down. Gloo does not: its
``abort()`` is a no-op in torch 2.13 and a collective blocked in a pair's receive only returns
on data, on its timeout, or when the pair's socket fails. So for gloo the aborter shuts down
(``shutdown(SHUT_RDWR)``, the descriptor stays gloo's to close) this process's TCP connections
to the other ranks; gloo then fails every pending operation with "Connection closed by peer",
which the guard turns into ``RankFailedError``. The groups are unusable afterwards, as after an
NCCL abort: destroy the context.

Which sockets are gloo's is learned from ``/proc`` (Linux only): every rank publishes the local
endpoints of its TCP sockets on the failure board once its groups exist, and the aborter cuts
the connections whose remote end is another rank's published endpoint or whose local end is one
of this rank's listening ports. Connections of the rendezvous store (its port) are never cut,
so the board stays readable, and neither are the sockets this process held before the context
built its groups: the default group, a test harness's group, a user's own connections belong to
others and must survive this context's failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # C++

__all__ = ["GroupAborter", "store_port", "tcp_inodes", "tcp_sockets"]

_LISTEN = "0A"
_ESTABLISHED = "01"


@dataclass(frozen=True)
class _Socket:
    """One TCP socket of this process, from ``/proc/self/net/tcp{,6}``."""

    fd: int
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str


def _address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (the kernel's little-endian words) -> ``('127.0.0.1', 8080)``."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is printed in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def tcp_sockets() -> list[_Socket]:
    """The TCP sockets this process holds (empty where ``/proc`` is not available)."""
    inodes: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                inodes[int(link[8:-1])] = int(name)
    found: list[_Socket] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or int(parts[9]) not in inodes:
                continue
            inode = int(parts[9])
            found.append(
                _Socket(inodes[inode], inode, _address(parts[1]), _address(parts[2]), parts[3])
            )
    return found


def tcp_inodes() -> frozenset[int]:
    """The inodes of this process's TCP sockets now (to spare them from a later abort)."""
    return frozenset(s.inode for s in tcp_sockets())


def store_port(store: Store | None) -> int | None:
    """The port of the TCPStore under ``store`` (through PrefixStores), if it is one."""
    for _ in range(16):
        if isinstance(store, TCPStore):
            return int(store.port)
        if not isinstance(store, PrefixStore):
            return None
        store = store.underlying_store
    return None


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::")


class GroupAborter:
    """Aborts the process groups of one context so that blocked collectives return.

    Args:
        groups: The groups to abort (their backends' ``abort()`` is called; NCCL's works).
        backend: The context's backend; gloo connections are cut as described above.
        exclude_port: The rendezvous store's port, whose connections are never cut.
        spared_inodes: Sockets that existed before the groups were built (``tcp_inodes()``
            then): never published, never cut.
    """

    def __init__(
        self,
        groups: Callable[[], Sequence[dist.ProcessGroup]],
        backend: str,
        exclude_port: int | None,
        spared_inodes: frozenset[int] = frozenset(),
    ) -> None:
        self._groups = groups
        self._backend = backend
        self._gloo = "gloo" in backend
        self._exclude = exclude_port
        self._spared = spared_inodes

    def _own(self, s: _Socket) -> bool:
        """Whether ``s`` may belong to one of the groups (not the store's, not older)."""
        return s.inode not in self._spared and self._exclude not in (s.local[1], s.remote[1])

    def endpoints(self) -> list[str]:
        """This rank's TCP endpoints (``host:port``), published so its peers can cut links."""
        return sorted(
            {
                f"{s.local[0]}:{s.local[1]}"
                for s in tcp_sockets()
                if self._own(s) and s.state in (_LISTEN, _ESTABLISHED)
            }
        )

    def abort(self, peer_endpoints: Iterable[str]) -> int:
        """Abort the groups; returns how many gloo connections were cut.

        Gloo's connections are cut first; its ``abort()`` does nothing a blocked collective
        notices, so a pure gloo context calls no backend at all (one place less for the
        aborting thread to wait in). Any other backend's groups (NCCL's) are aborted.
        """
        cut = self._cut(peer_endpoints) if self._gloo else 0
        if self._backend != "gloo":
            for group in self._groups():
                with contextlib.suppress(Exception):  # a destroyed group: already gone
                    group.abort()
        return cut

    def _cut(self, peer_endpoints: Iterable[str]) -> int:
        """Shut down this context's connections to the peers; returns how many."""
        peers: set[tuple[str, int]] = set()
        wildcard_ports: set[int] = set()
        for text in peer_endpoints:
            host, _, port = text.rpartition(":")
            if _is_wildcard(host):
                wildcard_ports.add(int(port))
            else:
                peers.add((host, int(port)))
        sockets = tcp_sockets()
        listening = {s.local[1] for s in sockets if s.state == _LISTEN and self._own(s)}
        cut = 0
        for s in sockets:
            if s.state != _ESTABLISHED or not self._own(s):
                continue
            if s.remote in peers or s.remote[1] in wildcard_ports or s.local[1] in listening:
                cut += _shutdown(s)
        return cut


def _shutdown(s: _Socket) -> int:
    """Shut ``s`` down through a duplicate of its descriptor, if it is still the same socket."""
    try:
        fd = os.dup(s.fd)
    except OSError:  # closed meanwhile
        return 0
    try:
        if os.fstat(fd).st_ino != s.inode:  # the number was reused for something else
            return 0
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return 0
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.close()  # closes only the duplicate
