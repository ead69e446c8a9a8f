"""`manage.py serve`: the operator listener and the agent gateway, two TLS listeners in one daphne process.

Requests are routed by the listener (port) they arrive on, so the two listeners need different ports.
There is no plaintext option.
"""

# daphne.server installs twisted's asyncio reactor on import; anything importing the reactor first
# would leave twisted with its default reactor, which daphne cannot run on.
import daphne.server  # isort: skip
import daphne.ws_protocol  # isort: skip

import asyncio
import gc
import logging
import os
import shlex
import signal
import sys

from django.conf import settings
from django.core.management.base import CommandError
from django.db import DatabaseError, OperationalError, connections
from twisted.internet.error import CannotListenError
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    STDLibLogObserver,
    globalLogPublisher,
)

from agent.bundle import MAX_GATEWAYS
from agent.collector_time import collector_time
from agent.protocol import CLOSE_SHUTDOWN, MAX_MESSAGE_BYTES
from controlplane import connection_limits, heavy_pool, metrics, runtime, tls
from controlplane.data_dir import data_dir_check
from controlplane.database import database_migrate, pending_migrations
from controlplane.heavy_pool import HeavyPool
from controlplane.http_limits import limited_channel_protocol
from controlplane.listeners import (
    GATEWAY,
    OPERATOR,
    ListenAddress,
    ListenAddressError,
    bracket,
    parse_listen,
    split_address,
    this_host_name,
)
from controlplane.management.base import PalisadeCommand
from controlplane.outage import database_failed
from controlplane.websocket_tuning import websocket_debug_arguments_cheapen

log = logging.getLogger("palisade.serve")


# The cyclic garbage collector took 7 % of serve's CPU under flow reports (perf): each report makes
# hundreds of short-lived containers (its parsed JSON, its rows), so the youngest generation filled
# every report or two, and each full collection walked everything serve loaded at start (Django, the
# URL confs, the models) again. What exists when serve starts to listen lives as long as it does:
# frozen, the collector no longer walks it; and the youngest generation is collected every
# GC_YOUNG_THRESHOLD allocations, tens of reports, not every one.
GC_YOUNG_THRESHOLD = 20_000
APPLICATION_CHECK_SECONDS = 5
# The reactor thread (TLS, HTTP, websockets) gives the GIL up at every socket call, and the gateway's
# database threads, busy with Python work of their own, kept it up to the interpreter's switch
# interval (5 ms) each time before it came back: through a failover of 10,000 agents the survivor's
# reactor was idle in only 11 % of its samples, yet the process used 0.7 of a core. At 1 ms: 58.7 s
# instead of 64.5-65.2 (docs/benchmarks.md, History: "The GIL's switch interval").
GIL_SWITCH_SECONDS = 0.001
# autobahn drops a websocket upgrade that the application has not accepted within daphne's handshake
# time, with no HTTP answer, and its timer is rounded down to whole seconds: daphne's 5 s were 4-5 s. A
# loaded serve (a failover; a busy CI machine) can take that long to reach a stream's accept, and the
# agent waits 10 s for its stream to open (agent/daemon.py HANDSHAKE_SECONDS): serve waits as long, so
# the TLS handshake it paid for is not thrown away. A stream accepted then has 10 s to authenticate.
UPGRADE_ACCEPT_SECONDS = 10


def _switch_interval_tune() -> None:
    sys.setswitchinterval(GIL_SWITCH_SECONDS)


def _collector_tune() -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    collector_time.install()  # palisade_gc_seconds_total


class _Server(daphne.server.Server):
    """daphne stops quietly, and exits 0, when it cannot listen; keep the reason so serve can fail.
    daphne also drops open websockets at shutdown without a word; agents should hear 4503 and the
    fleet should record their streams as ended, rather than show them connected to nothing."""

    listen_failure: Exception | None = None
    limiter: connection_limits.ConnectionLimiter | None = None
    heavy: HeavyPool | None = None

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("websocket_handshake_timeout", UPGRADE_ACCEPT_SECONDS)
        super().__init__(*args, **kwargs)

    def listen_success(self, port):
        # Before the reactor runs, so before the first connection is accepted.
        if self.limiter is not None:
            self.limiter.install(port)
        super().listen_success(port)

    def listen_error(self, failure):
        self.listen_failure = failure.value
        self.stop()

    def run(self):
        from twisted.internet import reactor, task, threads

        from controlplane.body_gate import credential_watch
        from controlplane.housekeeping import STEPS
        from fleet.push import notify_streams_on

        reactor.addSystemEventTrigger("before", "shutdown", self.end_streams)
        reactor.addSystemEventTrigger("before", "shutdown", credential_watch.stop)
        reactor.callWhenRunning(credential_watch.start)
        if self.heavy is not None:
            heavy = self.heavy
            reactor.addSystemEventTrigger("before", "shutdown", lambda: threads.deferToThread(heavy.stop))
        # daphne builds its HTTP factory in run(); no connection is accepted before the reactor runs.
        reactor.callWhenRunning(lambda: setattr(self.http_factory, "protocol", limited_channel_protocol))
        reactor.callWhenRunning(lambda: setattr(self.ws_factory, "protocol", _ReasonedWebSocket))
        if self.verbosity < 2:
            # Twisted formats an access line for every request and hands it to its log, which drops it
            # below verbosity 2 (palisade.access has our own line): about 3 % of the reactor's time.
            reactor.callWhenRunning(lambda: setattr(self.http_factory, "log", _no_access_line))
        reactor.callWhenRunning(lambda: notify_streams_on(asyncio.get_event_loop()))
        if self.limiter is not None:
            reactor.callWhenRunning(self.limiter.start)
        metrics.housekeeping_steps(STEPS)
        for step in STEPS:
            loop = task.LoopingCall(_scheduled, step)
            loop.start(step.every_seconds, now=False).addErrback(
                lambda failure, name=step.name: log.error("%s stopped: %s", name, failure.getErrorMessage())
            )
        websocket_debug_arguments_cheapen()
        _collector_tune()
        _switch_interval_tune()
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

    _application_checks = 0

    def application_checker(self):
        """daphne walks every connection each second to reap the applications that ended, and with
        10,000 streams held that walk was 3.5-4.3 % of serve's time, idle or failing over. Every
        APPLICATION_CHECK_SECONDS is soon enough: an ended application is reaped a few seconds later,
        and the 10 s daphne gives one to close is enforced to within those seconds."""
        from twisted.internet import reactor

        self._application_checks += 1
        if self._application_checks % APPLICATION_CHECK_SECONDS:
            reactor.callLater(1, self.application_checker)  # daphne's own pace, skipped this time
            return
        super().application_checker()

    def end_streams(self):
        from autobahn.twisted.websocket import WebSocketServerProtocol
        from twisted.internet import threads

        from fleet.held_streams import streams_end_all

        for protocol in list(getattr(self, "connections", {})):
            if isinstance(protocol, WebSocketServerProtocol):
                protocol.sendClose(code=CLOSE_SHUTDOWN, reason="control plane shutting down")

        def record():
            try:
                ended = streams_end_all()
            except DatabaseError as error:  # the database away: the reaper of silent streams ends them
                log.warning("cannot record the agent streams as ended: %s", _first_line(error))
                return
            finally:
                connections.close_all()
            if ended:
                log.info("recorded %d agent streams as ended", ended)

        # The database is not used from the event loop's thread; shutdown waits for this Deferred.
        return threads.deferToThread(record)


class _ReasonedWebSocket(daphne.ws_protocol.WebSocketProtocol):
    """daphne sends an application's close without its reason; the agent reads `retry after N s` in a
    4503's reason (agent/protocol.py), which without this never reached it over the network."""

    def handle_reply(self, message):
        if (
            message.get("type") == "websocket.close"
            and message.get("reason")
            and self.state == self.STATE_OPEN
        ):
            self.sendClose(code=message.get("code") or 1000, reason=str(message["reason"]))
            return
        super().handle_reply(message)


def _scheduled(step):
    """One round of a housekeeping step: database steps on a reactor thread, the stream sweep on the
    loop; a failure is one warning line, and the next period tries again."""
    from twisted.internet import threads
    from twisted.internet.defer import Deferred

    if step.run_async is not None:

        async def sweep():
            try:
                await step.run_async()
                metrics.housekeeping_succeeded(step)
            except Exception as error:  # noqa: BLE001 - the database away: the next round tries again
                metrics.housekeeping_failed(step)
                if not database_failed(step.name, error, log):
                    log.warning("cannot %s: %s", step.name, _first_line(error))

        return Deferred.fromFuture(asyncio.ensure_future(sweep()))

    def run():
        try:
            step.run()
            metrics.housekeeping_succeeded(step)
        except DatabaseError as error:
            metrics.housekeeping_failed(step)
            if not database_failed(step.name, error, log):
                log.warning("cannot %s: %s", step.name, _first_line(error))
        except Exception:  # a fault of ours: its traceback, and the step still runs next period
            metrics.housekeeping_failed(step)
            log.exception("%s failed; it runs again in %d s", step.name, step.every_seconds)
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
            "--flow-retention-days",
            type=int,
            help="keep stored flow windows and gaps this many days (default 30, or PALISADE_FLOW_RETENTION_DAYS)",
        )
        parser.add_argument(
            "--gateway-advertise",
            action="append",
            default=[],
            metavar="HOST:PORT",
            help=(
                "a gateway address given to agents (repeatable, in the order agents try them); every "
                "serve process of one control plane is given the same list and the same gateway "
                "certificate (docs/operations.md)"
            ),
        )
        parser.add_argument(
            "--no-migrate", action="store_true", help="do not apply database migrations at start"
        )
        connection_limits.add_arguments(parser)

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
        data_dir_check(settings.DATA_DIR, settings.DATABASES, log)
        try:
            operator = parse_listen("--operator-listen", options["operator_listen"])
            gateway = parse_listen("--gateway-listen", options["gateway_listen"])
        except ListenAddressError as error:
            raise CommandError(str(error)) from None
        if operator.port == gateway.port:
            raise CommandError(
                f"--operator-listen and --gateway-listen both use port {operator.port}; "
                "requests are routed by port, so the listeners need different ports"
            )
        self.listeners = (operator, gateway)
        if options["flow_retention_days"] is not None and options["flow_retention_days"] < 1:
            raise CommandError("--flow-retention-days must be at least 1")
        advertised = [value.strip() for value in options["gateway_advertise"]] or [
            value.strip() for value in settings.PALISADE_GATEWAY_ADVERTISE.split(",") if value.strip()
        ]
        for value in advertised:
            # Not resolved here: the name only has to resolve where the agents are.
            try:
                advertised_host = split_address("--gateway-advertise", value)[0]
            except ListenAddressError as error:
                raise CommandError(str(error)) from None
            if not advertised_host:
                raise CommandError("--gateway-advertise needs a host: HOST:PORT or [IPV6]:PORT")
        if len(set(advertised)) != len(advertised):
            raise CommandError("--gateway-advertise names the same address twice")
        if len(advertised) > MAX_GATEWAYS:
            raise CommandError(f"--gateway-advertise: at most {MAX_GATEWAYS} addresses")
        certs = {
            "operator": self._certificate("operator", operator, options),
            "gateway": self._certificate("gateway", gateway, options),
        }
        heavy_settings = heavy_pool.settings_problem()
        if heavy_settings is not None:
            raise CommandError(heavy_settings)
        if os.environ.get("PALISADE_HEAVY_THREADS"):
            log.warning(
                "PALISADE_HEAVY_THREADS is no longer read: heavy requests run in PALISADE_HEAVY_WORKERS "
                "worker processes (docs/operations.md)"
            )
        self._configure(operator, gateway, options)
        try:
            limits = connection_limits.serve_limits(options)
        except connection_limits.LimitsError as error:
            raise CommandError(str(error)) from None
        self._prepare_database(migrate=not options["no_migrate"])

        from controlplane.service_identity import gateway_addresses

        log.info(
            "operator listener %s certificate SHA-256 fingerprint %s",
            operator.url(),
            certs["operator"].fingerprint,
        )
        log.info(
            "gateway listener %s certificate SHA-256 fingerprint %s (agents are given %s)",
            gateway.url(),
            certs["gateway"].fingerprint,
            ", ".join(gateway_addresses()),
        )
        self._record_gateway_identity(certs["gateway"].fingerprint)
        self._refresh_stale_documents()
        self._hint_operator_password()
        if options["verbosity"] < 2:  # from 2 on, daphne passes twisted's whole log to the logging module
            _show_twisted_errors()

        from controlplane.asgi import application, heavy

        log.info(
            "heavy requests: %d worker processes (nice %d), %d more may wait, each for at most %g s and "
            "%d bytes of answer",
            heavy.workers,
            settings.PALISADE_HEAVY_NICE,
            heavy.limit - heavy.workers,
            heavy.deadline,
            settings.PALISADE_HEAVY_MAX_ANSWER_BYTES,
        )

        server = _Server(
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
        server.limiter = connection_limits.ConnectionLimiter(limits)
        server.heavy = heavy
        return server

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
        # The ASGI entry reads the listener ports per request, so they must be set before the first one.
        runtime.facts_set(
            listener_ports={operator.port: OPERATOR, gateway.port: GATEWAY},
            gateway_host=this_host_name() if gateway.is_wildcard else gateway.host,
            gateway_port=gateway.port,
            gateway_advertise=tuple(v.strip() for v in options["gateway_advertise"]) or None,
            site_label=options["site_label"],
            # Resolved here, so the retention serve records for the commands beside it is its own.
            flow_retention_days=options["flow_retention_days"] or settings.PALISADE_FLOW_RETENTION_DAYS,
        )

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

    def _refresh_stale_documents(self) -> None:
        from fleet.rendering import documents_refresh_if_stale

        try:
            refreshed = documents_refresh_if_stale()
        except DatabaseError as error:
            raise CommandError(f"cannot use the database: {_first_line(error)}") from None
        finally:
            connections.close_all()
        if refreshed is not None and refreshed.considered:
            log.info(
                "this release renders documents differently: re-rendered %d workloads, %d documents changed",
                refreshed.considered,
                len(refreshed.changed),
            )

    def _record_gateway_identity(self, fingerprint: str) -> None:
        """What provisioning bundles carry and agents bind their proofs to; commands run outside
        `serve` (minting a token on the host) read it from the database."""
        from controlplane.models import GatewayIdentity
        from controlplane.service_identity import gateway_addresses, gateway_identity_record

        runtime.facts_set(gateway_fingerprint=fingerprint)
        try:
            before = GatewayIdentity.objects.filter(id=1).first()
            if before is not None and before.fingerprint != fingerprint:
                # Another serve process of this control plane (or this one before) presented another
                # certificate: agents pinned to it refuse this gateway, and that one's agents this one.
                log.warning(
                    "the gateway certificate recorded by the last serve started (SHA-256 %s) is not the one "
                    "this process presents (%s): agents enrolled before refuse this gateway; give every "
                    "serve process the same gateway certificate and key (docs/operations.md, several serve "
                    "processes)",
                    before.fingerprint,
                    fingerprint,
                )
            listed = list(gateway_addresses())
            if before is not None and before.addresses and list(before.addresses) != listed:
                log.info(
                    "the gateways agents are given change from %s to %s: every serve process sends the new "
                    "list to the agents it holds",
                    ", ".join(before.addresses),
                    ", ".join(listed),
                )
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
            return f"cannot listen on {bracket(failure.interface or '*')}:{failure.port}: {reason.lower()}"
        return f"cannot listen: {_first_line(failure)}"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _no_access_line(request) -> None:
    return None


def _show_twisted_errors() -> None:
    """daphne discards twisted's log below verbosity 2; its warnings and errors still belong on stderr."""
    globalLogPublisher.addObserver(
        FilteringLogObserver(
            STDLibLogObserver(name="twisted"), [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)]
        )
    )
