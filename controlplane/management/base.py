"""The base of every Palisade host command: domain problems become one-line errors and a non-zero exit,
and `--json` gives scripts the same documents the API returns. Whatever a command prints reaches the
terminal with its control and format characters escaped (controlplane/text.py): agents' text may
carry ESC sequences or bidi overrides, and an operator's terminal must not obey them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, OutputWrapper

from controlplane.auth.actor import Actor, cli_actor
from controlplane.problems import Problem, ValidationFailed
from controlplane.strict_json import json_loads_strict
from controlplane.text import visible

EXIT_PROBLEM = 1
EXIT_VALIDATION = 2


_schema_checked = False


def _ensure_schema() -> None:
    """A host command may be the first thing run on a fresh data directory (operator-password before
    the first serve): bring the schema up to date first, once per process."""
    global _schema_checked
    if not _schema_checked:
        from controlplane.database import database_migrate

        database_migrate()
        _schema_checked = True


class EscapingOutput(OutputWrapper):
    """A command's standard output or error, escaping every control and format character but the line
    breaks and tabs of its own layout. A command escapes those too in each value it lays out
    (`visible`), so that no value can add a line; JSON output has none raw (json.dumps escapes them,
    ensure_ascii being left on)."""

    def write(self, msg="", style_func=None, ending=None):
        super().write(visible(msg, keep="\n\t"), style_func, ending)  # styled after: its own colours stay


def _escaping(out) -> EscapingOutput:
    if isinstance(out, EscapingOutput):
        return out
    return EscapingOutput(out._out if isinstance(out, OutputWrapper) else out)


def _action_method(action: str) -> str:
    return "do_" + action.replace("-", "_")


class PalisadeCommand(BaseCommand):
    json_output = True  # commands that print data offer --json
    migrates_itself = False  # serve applies migrations at start, or not with --no-migrate
    _argv: list[str] | None = None

    # BaseCommand sets both in __init__ and again in execute (call_command's stdout=); each is wrapped.
    @property
    def stdout(self) -> EscapingOutput:
        return self._stdout

    @stdout.setter
    def stdout(self, out) -> None:
        self._stdout = _escaping(out)

    @property
    def stderr(self) -> EscapingOutput:
        return self._stderr

    @stderr.setter
    def stderr(self, out) -> None:
        self._stderr = _escaping(out)

    def run_from_argv(self, argv):
        self._argv = list(argv)
        super().run_from_argv(argv)

    @property
    def actor(self) -> Actor:
        """Who the writes of this command are recorded as: its command line (or, called from code,
        its name)."""
        return cli_actor(self._argv or ["manage.py", self.__module__.rsplit(".", 1)[-1]])

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.epilog = (
            parser.epilog or ""
        ) + " Every command also takes --data-dir DIR (or PALISADE_DATA_DIR)."
        return parser

    def add_arguments(self, parser):
        if self.json_output:
            parser.add_argument("--json", action="store_true", help="print JSON for scripts")

    def add_actions(self, parser):
        """Subcommands (`mint`, `list`, ...), each accepting --json after its name as well. The command
        declares each with `add_parser(name, ...)` and runs it in its method `do_<name>` (`-` read as
        `_`), which `handle` calls."""
        actions = parser.add_subparsers(dest="action", required=True)
        add_parser = actions.add_parser

        def add_action(name, **kwargs):
            if not callable(getattr(self, _action_method(name), None)):
                raise TypeError(f"{type(self).__module__}: the action {name} has no {_action_method(name)}")
            sub = add_parser(name, **kwargs)
            sub.add_argument(
                "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
            )
            return sub

        actions.add_parser = add_action
        return actions

    def handle(self, *args, **options):
        """Run the action named on the command line (see add_actions); a command without actions
        writes its own handle."""
        if "action" not in options:
            return super().handle(*args, **options)
        getattr(self, _action_method(options["action"]))(options)

    def execute(self, *args, **options):
        self.as_json = bool(options.get("json"))
        try:
            if not self.migrates_itself:
                _ensure_schema()
            return super().execute(*args, **options)
        except Problem as problem:
            self.report_problem(problem)
            sys.exit(EXIT_VALIDATION if isinstance(problem, ValidationFailed) else EXIT_PROBLEM)
        except CommandError as error:
            self.stderr.write(f"error: {error}")
            sys.exit(error.returncode)

    def report_problem(self, problem: Problem) -> None:
        if self.as_json:
            self.stdout.write(json.dumps(problem.document(), indent=2))
            return
        if isinstance(problem, ValidationFailed):
            for finding in problem.findings:
                self.stderr.write(f"error: {finding.path or '/'}: {finding.message} [{finding.rule}]")
        else:
            self.stderr.write(f"error: {problem.detail} [{problem.name}]")

    def emit(self, data: Any, text: str) -> None:
        """Print `data` as JSON with --json, else the human `text`."""
        self.stdout.write(json.dumps(data, indent=2) if self.as_json else text)

    def read_json_input(self, source: str) -> Any:
        """JSON from a file path, or standard input for `-`."""
        try:
            raw = sys.stdin.read() if source == "-" else open(source, encoding="utf-8").read()
        except OSError as error:
            raise CommandError(f"cannot read {source}: {error.strerror}") from None
        return json_loads_strict(raw, what="standard input" if source == "-" else source)
