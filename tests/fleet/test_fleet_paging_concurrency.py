"""Paging the fleet while agents enrol concurrently (PostgreSQL, threads)."""

import threading

import pytest
from django.db import connection, connections

from fleet.selectors import workload_list
from tests.support.requirements import require
from tests.support.workloads import make_workload

pytestmark = pytest.mark.postgres


def test_walk_sees_every_original_workload_once_under_concurrent_inserts(transactional_db):
    require(connection.vendor == "postgresql", "needs PostgreSQL: set DATABASE_URL=postgresql://...")
    originals = {str(make_workload(hostname=f"h{i:03}", render=False).id) for i in range(0, 60, 2)}
    stop = threading.Event()

    def enrol():
        try:
            for i in range(1, 60, 2):
                if stop.is_set():
                    break
                make_workload(hostname=f"h{i:03}", render=False)
        finally:
            connections.close_all()

    writer = threading.Thread(target=enrol)
    writer.start()
    seen, cursor = [], None
    while True:
        page = workload_list(cursor=cursor, limit=4)
        seen += [str(w.id) for w in page.items]
        if not (cursor := page.next_cursor):
            break
    stop.set()
    writer.join()
    assert len(seen) == len(set(seen))
    assert originals <= set(seen)
