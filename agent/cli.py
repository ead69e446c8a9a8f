"""palisade-agent: enrol this host, run the daemon, show its status, pull the local kill switch.

Every failure an operator can meet is one line on stderr, `palisade-agent: error: ...`, and a
non-zero exit status, never a traceback: 3 when the host must be enrolled (again) first, 2 for a
command line that does not parse, 1 for everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable

from agent import __version__
from agent.errors import AgentError
from agent.state import DEFAULT_STATE_DIR

PROG = "palisade-agent"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too: keep it to one line
        self.exit(2, f"{PROG}: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


def check_root(command: str, euid: int | None = None) -> None:
    if (os.geteuid() if euid is None else euid) != 0:
        raise AgentError(
            f"'{command}' needs root (it changes and watches nftables); run it as root or with sudo"
        )


def nftables_dataplane():
    """The real dataplane, or AgentError naming what is missing."""
    try:
        from agent.dataplane import NftablesDataplane

        return NftablesDataplane()
    except ImportError as error:
        raise AgentError(
            f"the nftables Python module is missing ({error}); install the Debian package python3-nftables"
        ) from None
    except OSError as error:
        raise AgentError(
            f"libnftables cannot be loaded ({error}); install the Debian package libnftables1"
        ) from None


def _read_bundle(args: argparse.Namespace) -> str:
    if args.bundle is not None:
        return args.bundle
    try:
        if args.bundle_file == "-":
            return sys.stdin.read()
        with open(args.bundle_file, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise AgentError(f"cannot read the bundle file {args.bundle_file}: {reason}") from None


# --- commands ---


def cmd_enrol(args: argparse.Namespace) -> int:
    from agent.enrol import enrol

    if args.bundle is None and args.bundle_file is None and not args.reenrol:
        raise AgentError("enrol needs --bundle or --bundle-file (only --reenrol may go without one)")
    identity = enrol(
        _read_bundle(args) if args.bundle is not None or args.bundle_file is not None else None,
        args.state_dir,
        hostname=args.hostname,
        addresses=args.address,
        reenrol=args.reenrol,
    )
    verb = "re-enrolled" if args.reenrol else "enrolled"
    print(
        f"{verb} as workload {identity.workload_id} via {identity.gateway}; start the daemon with '{PROG} run'"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from agent.daemon import Agent
    from agent.eventlog import EventLog
    from agent.state import StateDir
    from agent.tablewatch import TableWatcher
    from agent.worker import DataplaneWorker

    if args.heartbeat_seconds <= 0:
        raise AgentError("--heartbeat-seconds must be positive")
    metrics = _metrics_textfile(args)
    check_root("run")
    state = StateDir(args.state_dir)
    state.load_identity()  # not enrolled: say so before touching anything else
    log = EventLog()
    worker = DataplaneWorker(nftables_dataplane)
    try:
        try:
            worker.start()
        except AgentError:
            raise
        except Exception as error:  # noqa: BLE001 - ApplyError from the first `list tables`, or any other
            raise AgentError(
                f"nftables does not answer: {getattr(error, 'message', None) or error}"
            ) from None
        try:
            watcher = TableWatcher().open()  # joined before the first table check, so nothing slips between
        except OSError as error:
            log("table watch unavailable", error=error.strerror or str(error))
            watcher = None
        agent = Agent(
            state,
            worker,
            heartbeat_seconds=args.heartbeat_seconds,
            watcher=watcher,
            log=log,
            flows=None if args.no_flows else _flow_reporter(args, state, log),
            metrics=metrics(log) if metrics is not None else None,
        )

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, agent.stop, signal.Signals(signum).name)
            await agent.run()

        asyncio.run(main())
    finally:
        worker.close()
    return 0


def _metrics_textfile(args: argparse.Namespace):
    """The metrics file's writer, given the log (checked before anything starts), or None."""
    if args.metrics_textfile is None:
        return None
    if not args.metrics_textfile.endswith(".prom"):
        # Any other name would be written faithfully and never read.
        raise AgentError(
            f"--metrics-textfile {args.metrics_textfile} must end in .prom "
            "(node_exporter's textfile collector reads only *.prom files)"
        )
    if args.metrics_interval_seconds <= 0:
        raise AgentError("--metrics-interval-seconds must be positive")
    from agent.metrics import MetricsTextfile

    return lambda log: MetricsTextfile(args.metrics_textfile, log=log, interval=args.metrics_interval_seconds)


def _flow_reporter(args: argparse.Namespace, state, log):
    """The flow evidence loop of `run`: conntrack for admitted and would-block connections, NFLOG for
    blocked attempts, reported to the gateway on their own."""
    from agent import conntrack, nflog
    from agent.flowreporter import FlowReporter, FlowSettings
    from agent.tablewatch import ABSENT

    settings = FlowSettings(
        window_seconds=args.flow_window_seconds,
        netlink_buffer=args.flow_netlink_buffer,
        buffer_records=args.flow_buffer_records,
        dump_max=args.flow_dump_max,
        window_keys=args.flow_window_keys,
    )
    for name in ("window_seconds", "netlink_buffer", "buffer_records", "dump_max", "window_keys"):
        if getattr(settings, name) <= 0:
            raise AgentError(f"--flow-{name.replace('_', '-')} must be positive")

    def make(agent):
        return FlowReporter(
            state,
            settings=settings,
            context=lambda: agent._context,
            policy_version=lambda: agent.applied_version or "",
            table_absent=lambda: agent.owned_table_reported == ABSENT,
            process_start_id=agent.process_start_id,
            log=log,
            sources={
                "conntrack": lambda windows: conntrack.ConntrackSource(
                    windows, buffer_bytes=settings.netlink_buffer, dump_max=settings.dump_max
                ),
                "nflog": lambda windows: nflog.NflogSource(windows, buffer_bytes=settings.netlink_buffer),
            },
            accounting=conntrack.accounting_enabled(),
            control_plane_clock=lambda: agent.server_now().timestamp(),
            on_status=agent.status.flows,
        )

    return make


def _flow_arguments(parser: argparse.ArgumentParser) -> None:
    from agent import flowreporter as defaults

    flows = parser.add_argument_group("flow evidence")
    flows.add_argument("--no-flows", action="store_true", help="report no flow evidence")
    flows.add_argument(
        "--flow-window-seconds",
        type=int,
        default=defaults.DEFAULT_WINDOW_SECONDS,
        help="window length (default 60)",
    )
    flows.add_argument(
        "--flow-netlink-buffer",
        type=int,
        default=defaults.DEFAULT_NETLINK_BUFFER,
        help=f"bytes of socket buffer per flow source (default {defaults.DEFAULT_NETLINK_BUFFER})",
    )
    flows.add_argument(
        "--flow-buffer-records",
        type=int,
        default=defaults.DEFAULT_BUFFER_RECORDS,
        help=f"closed windows kept while the control plane is unreachable (default {defaults.DEFAULT_BUFFER_RECORDS})",
    )
    flows.add_argument(
        "--flow-dump-max",
        type=int,
        default=defaults.DEFAULT_DUMP_MAX,
        help=f"connections read from the table at subscribe (default {defaults.DEFAULT_DUMP_MAX})",
    )
    flows.add_argument(
        "--flow-window-keys",
        type=int,
        default=defaults.DEFAULT_WINDOW_KEYS,
        help=(
            f"distinct keys one window counts one by one (default {defaults.DEFAULT_WINDOW_KEYS}); "
            "the others are summed into its aggregate keys, a keys_aggregated gap"
        ),
    )


def cmd_status(args: argparse.Namespace) -> int:
    from agent import status
    from agent.state import StateDir

    doc = status.collect(StateDir(args.state_dir))
    print(status.to_json(doc) if args.json else status.render(doc))
    return 0


def cmd_remove_table(args: argparse.Namespace) -> int:
    from agent.dataplane import TABLE, ApplyError

    check_root("remove-table")
    try:
        removed = nftables_dataplane().remove()
    except ApplyError as error:
        raise AgentError(f"cannot delete table {TABLE}: {error.message}") from None
    if removed:
        print(f"deleted table {TABLE}; a running agent reports it absent, and the next snapshot restores it")
    else:
        print(f"table {TABLE} was not present")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.simulated import run_simulated_fleet

    if args.heartbeat_seconds <= 0:
        raise AgentError("--heartbeat-seconds must be positive")
    if args.start_rate <= 0:
        raise AgentError("--start-rate must be positive")
    if args.open_seconds <= 0:
        raise AgentError("--open-seconds must be positive")
    return run_simulated_fleet(
        _read_bundle(args),
        args.count,
        args.state_root,
        heartbeat_seconds=args.heartbeat_seconds,
        duration=args.duration,
        verbose=args.verbose,
        first_index=args.first_index,
        start_rate=args.start_rate,
        open_seconds=args.open_seconds,
    )


# --- the command line ---


def _bundle_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--bundle", help="the enrolment bundle (palisade-enrol-v1:... or v2:...)")
    source.add_argument(
        "--bundle-file", metavar="FILE", help="read the enrolment bundle from FILE ('-': stdin)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="The Palisade agent.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    def state_dir(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help=f"default {DEFAULT_STATE_DIR}")

    enrol = command("enrol", cmd_enrol, "enrol this host with a provisioning bundle")
    _bundle_options(enrol, required=False)
    state_dir(enrol)
    enrol.add_argument("--hostname", help="the name to enrol under (default: this host's name)")
    enrol.add_argument(
        "--address",
        action="append",
        metavar="ADDR",
        help="an address of this host (repeat; default: its global addresses)",
    )
    enrol.add_argument(
        "--reenrol",
        action="store_true",
        help="enrol the same workload again with a new key, signed with the current one; the bundle "
        "(optional then) must carry a token minted for this workload if the current key cannot do",
    )

    run = command("run", cmd_run, "run the agent daemon (root)")
    state_dir(run)
    run.add_argument("--heartbeat-seconds", type=float, default=15.0, help="default 15")
    run.add_argument(
        "--metrics-textfile",
        metavar="PATH",
        help="write metrics for node_exporter's textfile collector to PATH (*.prom; e.g. "
        "/var/lib/prometheus/node-exporter/palisade-agent.prom)",
    )
    run.add_argument(
        "--metrics-interval-seconds",
        type=float,
        default=15.0,
        help="rewrite the metrics file this often, and soon after a notable change (default 15)",
    )
    _flow_arguments(run)

    status = command("status", cmd_status, "show what the agent last saw")
    state_dir(status)
    status.add_argument("--json", action="store_true", help="print JSON")

    remove = command(
        "remove-table", cmd_remove_table, "delete table inet palisade: the local kill switch (root)"
    )
    state_dir(remove)

    simulate = command("simulate", cmd_simulate, "run many simulated agents in one process (no kernel)")
    _bundle_options(simulate)
    simulate.add_argument("--count", type=int, required=True, help="how many agents")
    simulate.add_argument(
        "--first-index",
        type=int,
        default=1,
        help="number the agents from here (default 1); each number has its own host name and addresses,"
        " so simulators sharing a control plane need numbers of their own",
    )
    simulate.add_argument("--state-root", required=True, help="one state directory per agent goes here")
    simulate.add_argument("--heartbeat-seconds", type=float, default=15.0, help="default 15")
    simulate.add_argument(
        "--start-rate",
        type=float,
        default=200.0,
        help="agents started per second once all are enrolled (default 200); a machine that cannot take"
        " that many handshakes in 10 s needs fewer",
    )
    simulate.add_argument(
        "--open-seconds",
        type=float,
        default=10.0,
        help="each agent's time for TLS and the websocket upgrade (default 10, the real agent's); a"
        " simulator holding thousands of agents on a share of a core waits for its own loop as well",
    )
    simulate.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    simulate.add_argument(
        "--verbose", action="store_true", help="log every agent's events, not just summaries"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except AgentError as error:
        print(f"{PROG}: error: {error.message}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr)
        return 130
