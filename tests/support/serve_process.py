"""The real `manage.py serve` process, for end-to-end tests and benchmarks.

    with Site.fresh(tmp_path / "data") as site:       # a data directory and its own database
        site.set_operator_password("...")
        serve = site.serve()                          # started, both listeners answering TLS
        with serve.client("operator") as http:        # httpx, pinned to the certificate served
            http.get("/api/v1/me", headers={"Authorization": f"Bearer {site.mint_operator_token()}"})
        assert serve.stop() == 0                      # SIGTERM

With DATABASE_URL set, `Site.fresh` creates a throwaway database on that server (dropped afterwards),
so every site starts empty whatever the storage; without it the server uses SQLite in the data directory.

`Site.fresh(..., migrated=True)` starts the site with the schema already applied instead: a copy of a
database that the real `manage.py migrate` built once per test process (PostgreSQL: CREATE DATABASE
... TEMPLATE; SQLite: the file copied into the data directory). Applying every migration is most of
serve's first start (5-10 s on the 2-core CI machine, on either storage); a test about something else
need not pay it again. The tests of a first start on empty storage (tests/e2e/test_serve.py) do not
ask for it.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

REPO = Path(__file__).resolve().parents[2]
MANAGE = REPO / "manage.py"
START_TIMEOUT = 90.0
STOP_TIMEOUT = 20.0


def terminate(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def connect_host(listen: str) -> str:
    """Where a client reaches a listener given as :PORT, HOST:PORT or [IPV6]:PORT."""
    host = listen.rpartition(":")[0]
    if host.startswith("["):
        return host[1:-1]
    return host or "127.0.0.1"


def listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def served_certificate(host: str, port: int, timeout: float = 5.0) -> bytes:
    """The DER certificate a TLS listener presents (no verification: this is what we check)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with context.wrap_socket(raw, server_hostname=None) as tls:
            return tls.getpeercert(binary_form=True)


def fingerprint(der: bytes) -> str:
    """Colon hex, as `openssl x509 -fingerprint -sha256` and serve's log print it."""
    return hashlib.sha256(der).digest().hex(":").upper()


def pinned_context(der: bytes) -> ssl.SSLContext:
    """Trusts exactly this certificate, checked in the handshake (the agent pins the same way)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=ssl.DER_cert_to_PEM_cert(der))
    return context


class ServeExited(AssertionError):
    pass


class _HostCommands:
    """The host command line (`manage.py ...`) on the same data directory and database as the server."""

    data_dir: Path
    database_url: str | None

    def manage(self, *args: str, input: str | None = None, check: bool = True):
        return manage(self.data_dir, *args, database_url=self.database_url, input=input, check=check)

    def set_operator_password(self, password: str) -> None:
        self.manage("operator-password", "--stdin", input=password + "\n")

    def mint_operator_token(self, name: str = "e2e") -> str:
        return json.loads(self.manage("operator-token", "mint", "--name", name, "--json").stdout)["token"]


def _server_env(database_url: str | None, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PALISADE_DATA_DIR")}
    if database_url:
        env["DATABASE_URL"] = database_url
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def manage(data_dir: Path, *args: str, database_url: str | None = None, input: str | None = None, check=True):
    """`manage.py ARGS --data-dir DATA_DIR` with the same storage as the server."""
    result = subprocess.run(
        [sys.executable, str(MANAGE), *args, "--data-dir", str(data_dir)],
        input=input,
        capture_output=True,
        text=True,
        env=_server_env(database_url),
        cwd=REPO,
        timeout=120,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"manage.py {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
        )
    return result


class ServeProcess(_HostCommands):
    """One `manage.py serve` process. Listens on 127.0.0.1 and free ports unless told otherwise."""

    def __init__(
        self,
        data_dir: Path | str,
        extra_args: tuple | list = (),
        *,
        database_url: str | None = None,
        operator_listen: str | None = None,
        gateway_listen: str | None = None,
        env: dict | None = None,
        command_prefix: tuple | list = (),
        migrated: bool = False,
    ):
        self.data_dir = Path(data_dir)
        # SQLite only (a database_url names its own database: see throwaway_database(migrated=True)).
        self.migrated = migrated
        self.command_prefix = list(command_prefix)  # e.g. ("prlimit", "--nofile=1024"): run serve under it
        self.database_url = database_url
        self.operator_listen = operator_listen or f"127.0.0.1:{free_port()}"
        self.gateway_listen = (
            gateway_listen or f"127.0.0.1:{_other_free_port(listen_port(self.operator_listen))}"
        )
        self.extra_args = list(extra_args)
        self.env = env
        self.process: subprocess.Popen | None = None
        self._stderr: list[str] = []
        self._stdout: list[str] = []
        self._served: dict[str, bytes] = {}

    # addresses

    def address(self, listener: str) -> tuple[str, int]:
        listen = self.operator_listen if listener == "operator" else self.gateway_listen
        return connect_host(listen), listen_port(listen)

    def url(self, listener: str) -> str:
        host, port = self.address(listener)
        host = f"[{host}]" if ":" in host else host
        return f"https://{host}:{port}"

    @property
    def operator_url(self) -> str:
        return self.url("operator")

    @property
    def gateway_url(self) -> str:
        return self.url("gateway")

    # life cycle

    @property
    def args(self) -> list[str]:
        return [
            *self.command_prefix,
            sys.executable,
            str(MANAGE),
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--operator-listen",
            self.operator_listen,
            "--gateway-listen",
            self.gateway_listen,
            *self.extra_args,
        ]

    def start(self, *, wait: bool = True, timeout: float = START_TIMEOUT) -> ServeProcess:
        if self.migrated and self.database_url is None and not (self.data_dir / "palisade.sqlite3").exists():
            migrated_sqlite_copy(self.data_dir)
        self.process = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_server_env(self.database_url, self.env),
            cwd=REPO,
            start_new_session=True,  # a Ctrl-C meant for pytest does not reach it; tests signal it themselves
            # A shell without job control starts background jobs with SIGINT ignored; serve must see it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        for stream, sink in ((self.process.stderr, self._stderr), (self.process.stdout, self._stdout)):
            threading.Thread(target=_drain, args=(stream, sink), daemon=True).start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until both listeners complete a TLS handshake."""
        deadline = time.monotonic() + timeout
        for listener in ("operator", "gateway"):
            while True:
                if self.process.poll() is not None:
                    self._wait_for_drain()
                    raise ServeExited(
                        f"serve exited {self.process.returncode} before listening:\n{self.stderr_text()}"
                    )
                try:
                    self._served[listener] = served_certificate(*self.address(listener), timeout=2)
                    break
                except (OSError, ssl.SSLError):
                    if time.monotonic() > deadline:
                        self.kill()
                        raise ServeExited(
                            f"serve did not listen within {timeout} s:\n{self.stderr_text()}"
                        ) from None
                    time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Signal the process and return its exit status (negative: killed by a signal)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"serve did not exit within {timeout} s:\n{self.stderr_text()}") from None
        self._wait_for_drain()
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def cpu_seconds(self) -> tuple[float, float]:
        """The CPU time serve's own process has used, and its child processes' (the heavy workers):
        those it reaped, and those still running."""
        ticks = os.sysconf("SC_CLK_TCK")

        def times(pid) -> list[int]:
            return [int(f) for f in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[11:15]]

        utime, stime, reaped_utime, reaped_stime = times(self.process.pid)
        children = 0
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                try:
                    children += sum(times(child)[:2])
                except FileNotFoundError:  # ended meanwhile: it counts as reaped from now on
                    continue
        return (utime + stime) / ticks, (reaped_utime + reaped_stime + children) / ticks

    def _wait_for_drain(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.process.stderr and not self.process.stderr.closed and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self) -> ServeProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    # what it logged and served

    def stderr_text(self) -> str:
        return "".join(self._stderr)

    def stdout_text(self) -> str:
        return "".join(self._stdout)

    def wait_for_stderr(self, pattern: str, timeout: float = 10.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.stderr_text(), re.MULTILINE)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(f"no line matching {pattern!r} in serve's stderr:\n{self.stderr_text()}")
            time.sleep(0.02)

    def logged_fingerprint(self, listener: str) -> str:
        return self.wait_for_stderr(rf"{listener} listener \S+ certificate SHA-256 fingerprint ([0-9A-F:]+)")[
            1
        ]

    def served_certificate(self, listener: str) -> bytes:
        return served_certificate(*self.address(listener))

    def operator_fingerprint_served(self) -> str:
        return fingerprint(self.served_certificate("operator"))

    def gateway_fingerprint_served(self) -> str:
        return fingerprint(self.served_certificate("gateway"))

    def client(self, listener: str = "operator", **kwargs) -> httpx.Client:
        """An httpx client for one listener that trusts exactly the certificate it served at start."""
        der = self._served.get(listener) or self.served_certificate(listener)
        hooks = {"response": [_check_against_the_published_schema]} if listener == "operator" else {}
        kwargs.setdefault("timeout", 30)
        return httpx.Client(
            base_url=self.url(listener), verify=pinned_context(der), event_hooks=hooks, **kwargs
        )


def _check_against_the_published_schema(response: httpx.Response) -> None:
    from tests.support.openapi_check import committed_document

    path = response.request.url.path
    if path.startswith("/api/v1/") and path not in ("/api/v1/schema", "/api/v1/docs"):
        response.read()
        committed_document().check(
            method=response.request.method,
            path=path,
            status=response.status_code,
            content_type=response.headers.get("content-type", ""),
            body=response.content,
        )


def _other_free_port(taken: int) -> int:
    while (port := free_port()) == taken:
        pass
    return port


def _drain(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
    stream.close()


def _admin_url(base_url: str) -> str:
    # The maintenance database: the one DATABASE_URL names need not exist (pytest-django makes its own).
    return urlunsplit(urlsplit(base_url)._replace(path="/postgres"))


def _admin_execute(base_url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(_admin_url(base_url), autocommit=True) as admin:
        admin.execute(statement)


# What `manage.py migrate` built once in this process, by storage: {base_url: template database name}
# and {"sqlite": directory holding the migrated palisade.sqlite3}. Removed when the process exits.
_migrated: dict[str, str] = {}


def _migrated_template_database(base_url: str) -> str:
    if base_url not in _migrated:
        name = f"palisade_e2e_template_{secrets.token_hex(6)}"
        _admin_execute(base_url, f'CREATE DATABASE "{name}"')
        atexit.register(_admin_execute, base_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        parts = urlsplit(base_url)
        scratch = tempfile.mkdtemp(prefix="palisade-template-")
        atexit.register(shutil.rmtree, scratch, True)
        # migrate's session has ended when it exits: CREATE DATABASE ... TEMPLATE needs none open.
        manage(Path(scratch), "migrate", database_url=urlunsplit(parts._replace(path=f"/{name}")))
        _migrated[base_url] = name
    return _migrated[base_url]


def migrated_sqlite_copy(data_dir: Path) -> None:
    """Put a SQLite database with every migration applied into `data_dir` (made private if new), as the
    first serve on it would have left it."""
    if "sqlite" not in _migrated:
        scratch = tempfile.mkdtemp(prefix="palisade-template-")
        atexit.register(shutil.rmtree, scratch, True)
        manage(Path(scratch), "migrate")
        _migrated["sqlite"] = scratch
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # migrate closed its connection: the main file holds everything (no -wal is left behind).
    shutil.copy2(Path(_migrated["sqlite"]) / "palisade.sqlite3", data_dir / "palisade.sqlite3")


@contextmanager
def throwaway_database(base_url: str | None = None, *, migrated: bool = False):
    """A fresh PostgreSQL database on the server of `base_url` (default: DATABASE_URL), dropped on exit;
    empty, or with every migration applied when `migrated`. Yields None when there is no PostgreSQL to
    use: the server then keeps SQLite in its data directory."""
    base_url = base_url if base_url is not None else os.environ.get("DATABASE_URL")
    if not base_url:
        yield None
        return
    name = f"palisade_e2e_{secrets.token_hex(6)}"
    template = f' TEMPLATE "{_migrated_template_database(base_url)}"' if migrated else ""
    _admin_execute(base_url, f'CREATE DATABASE "{name}"{template}')
    try:
        yield urlunsplit(urlsplit(base_url)._replace(path=f"/{name}"))
    finally:
        _admin_execute(base_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Site(_HostCommands):
    """A data directory and a database: the state one control plane keeps across restarts."""

    def __init__(self, data_dir: Path, database_url: str | None):
        self.data_dir = Path(data_dir)
        self.database_url = database_url
        self.processes: list[ServeProcess] = []

    @classmethod
    @contextmanager
    def fresh(cls, data_dir: Path, *, migrated: bool = False):
        """Empty storage, or storage with the schema applied when `migrated` (see the module's doc)."""
        with throwaway_database(migrated=migrated) as database_url:
            if migrated and database_url is None:
                migrated_sqlite_copy(data_dir)
            site = cls(data_dir, database_url)
            try:
                yield site
            finally:
                for process in site.processes:
                    process.kill()

    def process(self, extra_args=(), **kwargs) -> ServeProcess:
        """A serve process on this site, not started yet."""
        process = ServeProcess(self.data_dir, extra_args, database_url=self.database_url, **kwargs)
        self.processes.append(process)
        return process

    def serve(self, extra_args=(), **kwargs) -> ServeProcess:
        """A serve process on this site, started and answering TLS on both listeners."""
        return self.process(extra_args, **kwargs).start()

    def serve_together(self, count: int, extra_args=(), **kwargs) -> list[ServeProcess]:
        """`count` serve processes on this site, started at once and all answering: their start-ups
        (mostly imports) overlap rather than add up. Processes starting together on one site is what
        serve supports anyway (a lock each around migrations and certificate generation)."""
        processes = [self.process(extra_args, **kwargs).start(wait=False) for _ in range(count)]
        for process in processes:
            process.wait_ready()
        return processes
