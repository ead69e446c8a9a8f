"""The database schema: applied by `serve` at start, and by any host command run before the first
`serve` on a fresh data directory, so that `operator-password` works as a first step too."""

import fcntl
import logging
import os
import zlib
from contextlib import contextmanager

from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.executor import MigrationExecutor

log = logging.getLogger("palisade.database")

# pg_advisory_lock key shared by every process on one database: only one migrates at a time.
MIGRATE_LOCK_KEY = zlib.crc32(b"palisade:migrate")


def pending_migrations() -> list:
    executor = MigrationExecutor(connection)
    return executor.migration_plan(executor.loader.graph.leaf_nodes())


def database_migrate() -> None:
    with _migration_lock():
        pending = pending_migrations()
        if pending:
            log.info("applying %d database migrations", len(pending))
            call_command("migrate", interactive=False, verbosity=0)


@contextmanager
def _migration_lock():
    """Two serve processes starting together on one database must not both apply the same migration."""
    if connection.vendor == "postgresql":
        # Its own session, so that nothing migrate does to the default connection drops the lock.
        lock = connections.create_connection("default")
        try:
            with lock.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
            yield
        finally:
            lock.close()  # ending the session releases the lock
        return
    # SQLite lives in the data directory, so a lock file there covers everyone sharing the database.
    fd = os.open(settings.DATA_DIR / ".migrate.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
