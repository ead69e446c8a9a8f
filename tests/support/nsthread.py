"""Run code on a thread that lives in another network namespace.

A thread may join a network namespace on its own (setns with CLONE_NEWNET affects only the calling
thread), and sockets belong to the namespace they were created in. So the test process can talk to
a control plane inside a lab namespace without any route from the host's namespace.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _join(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns({path}): {os.strerror(error)}")
    finally:
        os.close(fd)


class NamespaceThread:
    """One worker thread inside `ip netns` namespace `name`; `call(fn, ...)` runs fn there."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=f"netns-{name}", initializer=_join, initargs=(f"/run/netns/{name}",)
        )

    def call(self, fn, *args, **kwargs):
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
