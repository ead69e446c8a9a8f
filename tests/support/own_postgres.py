"""A PostgreSQL server of a test's own, to stop and start under a running `serve`: a throwaway cluster
in a temporary directory on a free loopback port, run as the `postgres` user (initdb refuses root).

    with OwnPostgres.started() as postgres:
        url = postgres.database("palisade")     # a database on it, as a DATABASE_URL
        postgres.stop()                          # the outage
        postgres.start()
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from tests.support.serve_process import free_port

USER = "postgres"


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def unavailable_reason() -> str | None:
    """Why a cluster of our own cannot run here, or None when it can."""
    if _bin_dir() is None:
        return "no PostgreSQL server binaries under /usr/lib/postgresql"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no {USER} user to run PostgreSQL as"
    if os.geteuid() != 0:
        return "needs root, to run PostgreSQL as the postgres user"
    return None


class OwnPostgres:
    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="palisade-own-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        user = pwd.getpwnam(USER)
        os.chown(self.root, user.pw_uid, user.pw_gid)

    def _run(self, *args: str, timeout: float = 60) -> None:
        result = subprocess.run(
            ["runuser", "-u", USER, "--", *args], capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")

    def init(self) -> None:
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "trust", "--no-sync",
            "-E", "UTF8",
        )  # fmt: skip

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"),
            "-w", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def database(self, name: str) -> str:
        import psycopg

        url = f"postgresql://{USER}@127.0.0.1:{self.port}"
        with psycopg.connect(url + "/postgres", autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return f"{url}/{name}"

    @classmethod
    @contextmanager
    def started(cls):
        postgres = cls()
        try:
            postgres.init()
            postgres.start()
            yield postgres
        finally:
            subprocess.run(
                ["runuser", "-u", USER, "--", str(postgres.bin / "pg_ctl"), "-D", str(postgres.data),
                 "-m", "immediate", "-w", "stop"],
                capture_output=True, timeout=60,
            )  # fmt: skip
            shutil.rmtree(postgres.root, ignore_errors=True)
