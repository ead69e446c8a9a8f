"""Runs a dataplane's blocking calls off the event loop.

libnftables contexts must not be shared between threads, and a large apply takes seconds; so the
real dataplane is built inside one dedicated thread and every call runs there, in order, while the
event loop keeps answering pings and heartbeats. A simulated dataplane is cheap and runs inline:
thousands of simulated agents must not mean thousands of threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol


class Dataplane(Protocol):
    def apply(self, document: str) -> None: ...
    def table_present(self) -> bool: ...
    def remove(self) -> bool: ...
    def end_denied(self, document: str) -> int: ...


class DataplaneWorker:
    def __init__(self, factory: Callable[[], Dataplane], *, threaded: bool = True) -> None:
        self._factory = factory
        self._dataplane: Dataplane | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dataplane") if threaded else None

    @classmethod
    def inline(cls, dataplane: Dataplane) -> DataplaneWorker:
        return cls(lambda: dataplane, threaded=False)

    def _call(self, name: str, *args: Any) -> Any:
        if self._dataplane is None:
            self._dataplane = self._factory()  # in the worker thread: the thread owns the object
        return getattr(self._dataplane, name)(*args)

    async def _run(self, name: str, *args: Any) -> Any:
        if self._executor is None:
            return self._call(name, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, name, *args)

    def start(self) -> None:
        """Build the dataplane now (blocking), so that a missing libnftables shows at start-up."""
        if self._executor is None:
            self._call("table_present")
        else:
            self._executor.submit(self._call, "table_present").result()

    async def apply(self, document: str) -> None:
        await self._run("apply", document)

    async def table_present(self) -> bool:
        return bool(await self._run("table_present"))

    async def remove(self) -> bool:
        return bool(await self._run("remove"))

    async def end_denied(self, document: str) -> int:
        return int(await self._run("end_denied", document))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
