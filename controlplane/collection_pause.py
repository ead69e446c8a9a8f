"""The cyclic garbage collector held off while a heavy read builds its answer.

A fleet's suggestions or impact hold some 14,000 row dicts and as many tuples and lists while they
run: enough new objects that CPython's collector, which runs a full collection once the objects that
survived its younger generations grow by a quarter of the old ones, traversed the whole process (some
150,000 objects in a test process, more in a worker) once or twice per request, 100-190 ms of a
500 ms answer (measured with gc.callbacks, docs/benchmarks.md). What those reads build holds no
reference cycle: it is freed by reference counting as the answer is returned, so the collections
found nothing. Held off for the call, the collector runs again after it, when those objects are gone.

Nested and concurrent holds (threads of one process: commands, tests, a console in process) keep the
collector off until the last ends, and it is turned back on only if it was on when the first began.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_lock = threading.Lock()
_holds = 0
_was_enabled = False

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def collection_paused() -> Iterator[None]:
    global _holds, _was_enabled  # noqa: PLW0603 - one collector per process
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _was_enabled:
                gc.enable()


def without_collection(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run with the collector held off (`collection_paused`)."""

    @functools.wraps(function)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        with collection_paused():
            return function(*args, **kwargs)

    return held
