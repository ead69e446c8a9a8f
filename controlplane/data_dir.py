"""The data directory holds secrets: the database (the password hash, token digests), the secret key and
the listeners' private keys. What Palisade creates there is private to the user it runs as: the
directory 0700, its files 0600.

A directory the operator made (or one made by an earlier version) keeps its mode: `serve` warns at
start when others may read it, and names the chmod, rather than change a directory it did not create.
The database files are Palisade's own, so `serve` makes them private and says so.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600
# Group and others: any of these bits lets someone other than the owner in.
OTHERS = 0o077
# SQLite creates the -wal and -shm files with the database file's own mode.
SQLITE_SIDE_FILES = ("-wal", "-shm")


def data_dir_create(path: Path) -> None:
    """Create the data directory private when it does not exist yet."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIRECTORY)


def sqlite_file_create(path: Path) -> None:
    """Create the SQLite database file 0600 before SQLite does (it would follow the umask, 0644 as a
    rule): an empty file is an empty database, and its -wal and -shm files take its mode."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))


def data_dir_check(data_dir: Path, databases: dict, log: logging.Logger) -> None:
    """At serve's start: from here on every file serve creates is private (certificates, keys, lock
    files); warn about a data directory others may enter; make the SQLite database files private."""
    os.umask(OTHERS)
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if mode & OTHERS:
        log.warning(
            "the data directory %s is open to other users (mode %04o); make it private with: chmod 700 %s",
            data_dir,
            mode,
            data_dir,
        )
    database = databases["default"]
    if database["ENGINE"] not in ("controlplane.sqlite", "django.db.backends.sqlite3"):
        return
    sqlite_file = Path(database["NAME"])
    for path in (sqlite_file, *(Path(f"{sqlite_file}{suffix}") for suffix in SQLITE_SIDE_FILES)):
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue
        if not mode & OTHERS:
            continue
        try:
            path.chmod(mode & ~OTHERS)
        except OSError as error:  # another owner's file: say so, and serve on
            log.warning("%s is open to other users (mode %04o) and stays so: %s", path, mode, error.strerror)
        else:
            log.warning("%s was open to other users (mode %04o); made it %04o", path, mode, mode & ~OTHERS)
