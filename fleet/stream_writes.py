"""The streams' most frequent writes, gathered on serve's loop: what every stream of the process asks
while one statement runs goes into the next, one thread hop and one statement for all of them.

After a fleet-wide change every stream asks for its snapshot, then thousands of agents acknowledge
within seconds; one statement and one hop to a database thread each (fleet/held_streams.py `db`)
kept the eight threads and PostgreSQL busy with commits of one row. A stream waits for its own write as before (its next frame is read after), and a
write that fails fails every stream of its round alike: a database away or busy is every stream's
failure at once, which each stream's dispatch handles as before (fleet/gateway.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fleet import held_streams, streams, sync

ROUND_MOST = 1_000  # a round's statement stays short: a larger crowd waits for the next round


class Gathered:
    def __init__(self, write: Callable[..., list | None], argument: str) -> None:
        """`write(**{argument: items})` stores every item of a round (one statement on PostgreSQL) and
        returns each item's outcome in order, or None for none."""
        self._write = held_streams.db(write)
        self._argument = argument
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._writing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, item: Any) -> Any:
        """Store `item` with whatever else arrives meanwhile: its outcome, or what the round raised."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # serve has one loop; a test suite one per test
            self._loop, self._waiting, self._writing = loop, [], False
        done = loop.create_future()
        self._waiting.append((item, done))
        if not self._writing:
            self._writing = True
            asyncio.ensure_future(self._rounds())
        return await done

    async def _rounds(self) -> None:
        try:
            while self._waiting:
                round_, self._waiting = self._waiting[:ROUND_MOST], self._waiting[ROUND_MOST:]
                try:
                    outcomes = await self._write(**{self._argument: [item for item, _ in round_]})
                except Exception as error:  # noqa: BLE001 - handed to every stream of the round
                    for _, done in round_:
                        if not done.done():
                            done.set_exception(error)
                    continue
                for index, (_, done) in enumerate(round_):
                    if not done.done():
                        done.set_result(None if outcomes is None else outcomes[index])
        finally:
            self._writing = False


applied = Gathered(sync.workloads_applied, "acknowledgements")
snapshots = Gathered(streams.streams_snapshots, "requests")
