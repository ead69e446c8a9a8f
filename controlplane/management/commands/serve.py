"""`manage.py serve`: the operator listener and the agent gateway, two TLS listeners in one daphne process.

Requests are routed by the listener (port) they arrive on, so the two listeners need different ports.
There is no plaintext option.
"""

# daphne.server installs twisted's asyncio reactor on import; anything importing the reactor first
# would leave twisted with its default reactor, which daphne cannot run on.
import daphne.server  # isort: skip

import asyncio
import ipaddress
import logging
import os
import re
import shlex
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.management.base import CommandError
from django.db import DatabaseError, OperationalError, connections
from twisted.internet.endpoints import quoteStringArgument
from twisted.internet.error import CannotListenError
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    STDLibLogObserver,
    globalLogPublisher,
)

from agent.protocol import CLOSE_SHUTDOWN, MAX_MESSAGE_BYTES
from controlplane import tls
from controlplane.database import database_migrate, pending_migrations
from controlplane.http_limits import limited_channel_protocol
from controlplane.management.base import PalisadeCommand

log = logging.getLogger("palisade.serve")

# Heartbeats refresh a stream's last_heard_from at least every minute; a stream silent for three
# is one whose serve process died.
STREAM_REAP_EVERY_SECONDS = 60
STREAM_SILENT_SECONDS = 180
# Rendered documents no workload names are removed once they are an hour old (fleet.retention).
PRUNE_DOCUMENTS_EVERY_SECONDS = 600
UNREFERENCED_DOCUMENT_GRACE_SECONDS = 3600

_LISTEN = re.compile(r"^(?:\[(?P<ipv6>[^\]]*)\]|(?P<host>[^:\[\]]*)):(?P<port>[0-9]{1,5})$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class ListenAddress:
    flag: str
    host: str  # as given: "" for all interfaces, a host name, or an IP address
    interface: str  # the IP address to bind
    port: int

    @property
    def is_wildcard(self) -> bool:
        return self.host == ""

    def __str__(self) -> str:
        return f"{_bracket(self.interface)}:{self.port}"

    def url(self) -> str:
        host = _this_host_name() if self.is_wildcard else _bracket(self.host)
        return f"https://{host}:{self.port}/"

    def endpoint(self, cert: tls.CertPaths) -> str:
        parts = [
            "ssl",
            f"port={self.port}",
            f"interface={quoteStringArgument(self.interface)}",
            f"privateKey={quoteStringArgument(str(cert.key_path))}",
            f"certKey={quoteStringArgument(str(cert.cert_path))}",
        ]
        if cert.chain_path:
            parts.append(f"extraCertChain={quoteStringArgument(str(cert.chain_path))}")
        return ":".join(parts)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _this_host_name() -> str:
    # getfqdn() gives "localhost" on hosts whose name is an alias of 127.0.0.1; nobody else can use that.
    fqdn = socket.getfqdn()
    return socket.gethostname() if fqdn.startswith("localhost") else fqdn


def _wildcard_interface() -> str:
    """`::` when this kernel does IPv6 with dual-stack sockets (it then accepts IPv4 too), else 0.0.0.0."""
    # Listening on every interface is the documented default for `--listen :PORT` (S104).
    if not socket.has_ipv6:
        return "0.0.0.0"  # noqa: S104
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::", 0))
            v6only = probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    except OSError:
        return "0.0.0.0"  # noqa: S104
    return "0.0.0.0" if v6only else "::"  # noqa: S104


def split_address(flag: str, value: str) -> tuple[str, str | None, int]:
    """`:PORT`, `HOST:PORT` or `[IPV6]:PORT` -> (host as given, its IP address if it is one, port)."""
    match = _LISTEN.match(value.strip())
    if not match or not 0 < int(match["port"]) < 65536:
        raise CommandError(
            f"{flag} {value!r}: expected :PORT, HOST:PORT or [IPV6]:PORT with a port from 1 to 65535"
        )
    port = int(match["port"])
    if match["ipv6"] is not None:
        try:
            address = str(ipaddress.IPv6Address(match["ipv6"]))
        except ValueError:
            raise CommandError(f"{flag} {value!r}: {match['ipv6']!r} is not an IPv6 address") from None
        return address, address, port
    host = match["host"]
    try:
        return host, str(ipaddress.IPv4Address(host)), port
    except ValueError:
        pass
    if host and not _HOST_NAME.match(host):
        raise CommandError(
            f"{flag} {value!r}: {host!r} is not a host name or IPv4 address (write IPv6 as [ADDR])"
        )
    return host, None, port


def parse_listen(flag: str, value: str) -> ListenAddress:
    """`:PORT` (all interfaces), `HOST:PORT` or `[IPV6]:PORT`; a host name is resolved to an address."""
    host, address, port = split_address(flag, value)
    if address is not None:
        return ListenAddress(flag, host, address, port)
    if host == "":
        return ListenAddress(flag, "", _wildcard_interface(), port)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise CommandError(f"{flag} {value!r}: cannot resolve {host}: {error.strerror}") from None
    return ListenAddress(flag, host, found[0][4][0], port)


class _Server(daphne.server.Server):
    """daphne stops quietly, and exits 0, when it cannot listen; keep the reason so serve can fail.
    daphne also drops open websockets at shutdown without a word; agents should hear 4503 and the
    fleet should record their streams as ended, rather than show them connected to nothing."""

    listen_failure: Exception | None = None

    def listen_error(self, failure):
        self.listen_failure = failure.value
        self.stop()

    def run(self):
        from twisted.internet import reactor, task

        from fleet.gateway import CATCH_UP_EVERY_SECONDS
        from fleet.rendering import notify_streams_on

        reactor.addSystemEventTrigger("before", "shutdown", self.end_streams)
        # daphne builds its HTTP factory in run(); no connection is accepted before the reactor runs.
        reactor.callWhenRunning(lambda: setattr(self.http_factory, "protocol", limited_channel_protocol))
        reactor.callWhenRunning(lambda: notify_streams_on(asyncio.get_event_loop()))
        reaper = task.LoopingCall(self.reap_streams)
        reaper.start(STREAM_REAP_EVERY_SECONDS, now=False).addErrback(
            lambda failure: log.error("stream reaper stopped: %s", failure.getErrorMessage())
        )
        pruner = task.LoopingCall(self.prune_documents)
        pruner.start(PRUNE_DOCUMENTS_EVERY_SECONDS, now=False).addErrback(
            lambda failure: log.error("document pruning stopped: %s", failure.getErrorMessage())
        )
        catch_up = task.LoopingCall(self.catch_up_streams)
        catch_up.start(CATCH_UP_EVERY_SECONDS, now=False).addErrback(
            lambda failure: log.error("stream catch-up stopped: %s", failure.getErrorMessage())
        )
        super().run()

    def kill_all_applications(self):
        """daphne's own version reads `details["application_instance"]` of every connection, and a
        websocket upgraded a moment before shutdown has none yet: its KeyError aborted the step that
        cancels open requests and streams (and logged a CRITICAL traceback)."""
        from twisted.internet.defer import Deferred

        pending = [
            instance
            for details in self.connections.values()
            if (instance := details.get("application_instance")) is not None and not instance.done()
        ]
        for instance in pending:
            instance.cancel()
        log.info("cancelled %d pending application instances", len(pending))
        waiting = Deferred.fromFuture(asyncio.gather(*pending))
        waiting.addErrback(lambda failure: None)
        return waiting

    def catch_up_streams(self):
        from twisted.internet.defer import Deferred

        from fleet.gateway import streams_catch_up

        async def sweep():
            try:
                await streams_catch_up()
            except Exception as error:  # noqa: BLE001 - the database away: the next sweep tries again
                log.warning("cannot compare streams with their latest versions: %s", _first_line(error))

        return Deferred.fromFuture(asyncio.ensure_future(sweep()))

    def reap_streams(self):
        """Streams left open by a serve process that died without recording them."""
        from fleet.sync import workload_streams_reap

        def reap():
            ended = workload_streams_reap(silent_for=timedelta(seconds=STREAM_SILENT_SECONDS))
            if ended:
                log.info("recorded %d silent agent streams as ended", ended)

        return _housekeeping("reap silent streams", reap)

    def prune_documents(self):
        """Rendered documents no workload names any more (fleet.retention)."""
        from fleet.retention import rendered_policies_prune

        def prune():
            removed = rendered_policies_prune(
                older_than=timedelta(seconds=UNREFERENCED_DOCUMENT_GRACE_SECONDS)
            )
            if removed:
                log.info("pruned %d rendered documents no workload names", removed)

        return _housekeeping("prune rendered documents", prune)

    def end_streams(self):
        from autobahn.twisted.websocket import WebSocketServerProtocol
        from twisted.internet import threads

        from fleet.gateway import streams_end_all

        for protocol in list(getattr(self, "connections", {})):
            if isinstance(protocol, WebSocketServerProtocol):
                protocol.sendClose(code=CLOSE_SHUTDOWN, reason="control plane shutting down")

        def record():
            try:
                ended = streams_end_all()
            finally:
                connections.close_all()
            if ended:
                log.info("recorded %d agent streams as ended", ended)

        # The database is not used from the event loop's thread; shutdown waits for this Deferred.
        return threads.deferToThread(record)


def _housekeeping(what: str, work):
    """Periodic database work on a reactor thread; a failure (the database away, a lost race) is
    one warning line, and the next period tries again."""
    from twisted.internet import threads

    def run():
        try:
            work()
        except DatabaseError as error:
            log.warning("cannot %s: %s", what, _first_line(error))
        finally:
            connections.close_all()

    return threads.deferToThread(run)


class _StopBeforeServing(Exception):
    pass


def _stop_before_serving(signum, frame):
    raise _StopBeforeServing(signal.Signals(signum).name)


class Command(PalisadeCommand):
    help = "Run the control plane: the operator listener (API and console) and the agent gateway, both TLS."
    json_output = False
    migrates_itself = True

    def add_arguments(self, parser):
        super().add_arguments(parser)
        for name, default in (("operator", ":8080"), ("gateway", ":8443")):
            parser.add_argument(
                f"--{name}-listen",
                default=default,
                metavar="ADDR",
                help=f":PORT, HOST:PORT or [IPV6]:PORT (default {default})",
            )
            parser.add_argument(
                f"--{name}-tls-cert", metavar="PEM", help=f"certificate (with --{name}-tls-key)"
            )
            parser.add_argument(
                f"--{name}-tls-key", metavar="PEM", help=f"private key (with --{name}-tls-cert)"
            )
            parser.add_argument(
                f"--{name}-san",
                action="append",
                default=[],
                metavar="NAME",
                help=(
                    "extra DNS name or IP address for the generated certificate (repeatable); once made, "
                    "the certificate is kept so its fingerprint stays: a name it lacks only gets a warning"
                ),
            )
        parser.add_argument("--site-label", help="a name for this site, shown in the console and GET /me")
        parser.add_argument(
            "--gateway-advertise", metavar="HOST:PORT", help="the gateway address given to agents"
        )
        parser.add_argument(
            "--no-migrate", action="store_true", help="do not apply database migrations at start"
        )

    def handle(self, *args, **options):
        # Until twisted takes over the signals, SIGTERM (like Ctrl-C) ends the start cleanly.
        signal.signal(signal.SIGTERM, _stop_before_serving)
        try:
            server = self._prepare(options)
            server.run()  # twisted's own SIGTERM/SIGINT handlers stop the reactor from here on
        except (_StopBeforeServing, KeyboardInterrupt):
            log.info("stopped before serving")
            return
        if server.listen_failure is not None:
            raise CommandError(self._listen_failure_text(server.listen_failure))
        log.info("stopped")

    def _prepare(self, options) -> _Server:
        operator = parse_listen("--operator-listen", options["operator_listen"])
        gateway = parse_listen("--gateway-listen", options["gateway_listen"])
        if operator.port == gateway.port:
            raise CommandError(
                f"--operator-listen and --gateway-listen both use port {operator.port}; "
                "requests are routed by port, so the listeners need different ports"
            )
        self.listeners = (operator, gateway)
        if options["gateway_advertise"]:
            # Not resolved here: the name only has to resolve where the agents are.
            if not split_address("--gateway-advertise", options["gateway_advertise"])[0]:
                raise CommandError("--gateway-advertise needs a host: HOST:PORT or [IPV6]:PORT")
        certs = {
            "operator": self._certificate("operator", operator, options),
            "gateway": self._certificate("gateway", gateway, options),
        }
        self._configure(operator, gateway, options)
        self._prepare_database(migrate=not options["no_migrate"])

        from controlplane.service_identity import gateway_address

        log.info(
            "operator listener %s certificate SHA-256 fingerprint %s",
            operator.url(),
            certs["operator"].fingerprint,
        )
        log.info(
            "gateway listener %s certificate SHA-256 fingerprint %s (agents are given %s)",
            gateway.url(),
            certs["gateway"].fingerprint,
            gateway_address(),
        )
        self._record_gateway_identity(certs["gateway"].fingerprint)
        self._hint_operator_password()
        if options["verbosity"] < 2:  # from 2 on, daphne passes twisted's whole log to the logging module
            _show_twisted_errors()

        from controlplane.asgi import application

        return _Server(
            application,
            endpoints=[operator.endpoint(certs["operator"]), gateway.endpoint(certs["gateway"])],
            signal_handlers=True,
            verbosity=options["verbosity"],
            # A snapshot of a large policy is one message; the protocol's bound, not daphne's 1 MiB.
            websocket_max_message_size=MAX_MESSAGE_BYTES,
            websocket_max_frame_size=MAX_MESSAGE_BYTES,
            ready_callable=lambda: log.info(
                "serving: console %s, API %sapi/v1/ (documentation at %sapi/v1/docs)",
                operator.url(),
                operator.url(),
                operator.url(),
            ),
        )

    def _certificate(self, name: str, listen: ListenAddress, options) -> tls.CertPaths:
        cert, key = options[f"{name}_tls_cert"], options[f"{name}_tls_key"]
        try:
            if cert and key:
                if options[f"{name}_san"]:
                    log.warning(
                        "--%s-san is ignored: it names the generated certificate, not a given one", name
                    )
                return tls.load_certificate(
                    cert, key, what=f"{name} TLS", chain_path=settings.DATA_DIR / f".{name}-given-chain.pem"
                )
            if cert or key:
                raise CommandError(
                    f"--{name}-tls-cert and --{name}-tls-key go together: give both or neither"
                )
            sans = list(options[f"{name}_san"])
            for value in sans:
                try:
                    tls.parse_san(value)
                except tls.CertificateError as error:
                    raise CommandError(f"--{name}-san: {error}") from None
            if not listen.is_wildcard:
                sans.append(listen.host)
            return tls.ensure_certificate(settings.DATA_DIR, name, sans)
        except tls.CertificateError as error:
            raise CommandError(str(error)) from None

    def _configure(self, operator: ListenAddress, gateway: ListenAddress, options) -> None:
        # The ASGI entry reads these per request, so they must be set before the first one.
        settings.PALISADE_LISTENER_PORTS = {operator.port: "operator", gateway.port: "gateway"}
        # The host name, not service_identity's getfqdn() fallback, which is "localhost" on some hosts.
        settings.PALISADE_GATEWAY_HOST = _this_host_name() if gateway.is_wildcard else gateway.host
        settings.PALISADE_GATEWAY_PORT = gateway.port
        if options["gateway_advertise"]:
            settings.PALISADE_GATEWAY_ADVERTISE = options["gateway_advertise"].strip()
        if options["site_label"] is not None:
            settings.PALISADE_SITE_LABEL = options["site_label"]

    def _prepare_database(self, *, migrate: bool) -> None:
        try:
            if migrate:
                self._migrate()
            else:
                pending = self._pending_migrations()
                if pending:
                    log.warning(
                        "%d database migrations are not applied; run ./manage.py migrate", len(pending)
                    )
        except OperationalError as error:
            raise CommandError(f"cannot use the database: {_first_line(error)}") from None
        finally:
            connections.close_all()

    def _migrate(self) -> None:
        database_migrate()

    def _pending_migrations(self) -> list:
        return pending_migrations()

    def _record_gateway_identity(self, fingerprint: str) -> None:
        """What provisioning bundles carry and agents bind their proofs to; commands run outside
        `serve` (minting a token on the host) read it from the database."""
        from controlplane.service_identity import gateway_identity_record

        settings.PALISADE_GATEWAY_FINGERPRINT = fingerprint
        try:
            gateway_identity_record(fingerprint=fingerprint)
        except DatabaseError as error:
            raise CommandError(f"cannot use the database: {_first_line(error)}") from None
        finally:
            connections.close_all()

    def _hint_operator_password(self) -> None:
        from controlplane.auth.selectors import operator_exists

        try:
            exists = operator_exists()
        except DatabaseError as error:
            log.error("cannot read the operator from the database: %s", _first_line(error))
            return
        finally:
            connections.close_all()
        if not exists:
            given = os.environ.get("PALISADE_DATA_DIR")  # manage.py puts --data-dir there
            data_dir = f" --data-dir {shlex.quote(str(settings.DATA_DIR))}" if given else ""
            # The interpreter that runs serve has the dependencies; a bare ./manage.py may not.
            manage = f"{shlex.quote(sys.executable)} {shlex.quote(str(settings.BASE_DIR / 'manage.py'))}"
            log.warning("no operator password is set; set it with: %s operator-password%s", manage, data_dir)

    def _listen_failure_text(self, failure: Exception) -> str:
        if isinstance(failure, CannotListenError):
            reason = failure.socketError
            reason = getattr(reason, "strerror", None) or str(reason)
            for listen in self.listeners:
                if listen.port == failure.port:
                    return f"cannot listen on {listen} ({listen.flag}): {reason.lower()}"
            return f"cannot listen on {_bracket(failure.interface or '*')}:{failure.port}: {reason.lower()}"
        return f"cannot listen: {_first_line(failure)}"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _show_twisted_errors() -> None:
    """daphne discards twisted's log below verbosity 2; its warnings and errors still belong on stderr."""
    globalLogPublisher.addObserver(
        FilteringLogObserver(
            STDLibLogObserver(name="twisted"), [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)]
        )
    )
