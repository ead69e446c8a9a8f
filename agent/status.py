"""status.json: the daemon writes it as things happen (DaemonStatus); `palisade-agent status` reads
it, together with the enrolment."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent import __version__
from agent.credential import CredentialError, credential_parse, format_instant
from agent.errors import AgentError
from agent.state import StateDir


def now_instant() -> str:
    return format_instant(datetime.now(UTC))


def daemon_running(pid: object) -> bool | None:
    """Whether the process that wrote the status still runs (None when unknown)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect(state: StateDir) -> dict[str, Any]:
    """The status document `status --json` prints. AgentError when not enrolled or unreadable."""
    identity = state.load_identity()
    status = state.read_status() or {}
    try:
        expires_at = credential_parse(state.load_credential())["expires_at"]
    except CredentialError:
        expires_at = None
    credential = dict(status.get("credential") or {})
    credential.setdefault("expires_at", expires_at)
    running = daemon_running(status.get("pid"))
    stream = dict(status.get("stream") or {"state": "disconnected", "since": None})
    if running is False:
        stream["state"] = "disconnected"  # the daemon died without saying so
    if stream.get("state") != "connected":
        stream["gateway"] = None
    stream.setdefault("gateway", None)
    return {
        "workload_id": identity.workload_id,
        "hostname": identity.hostname,
        "gateway": identity.gateway,
        "gateways": state.load_gateways(identity),
        "gateway_fingerprint": identity.fingerprint,
        "enrolled_at": identity.enrolled_at,
        "daemon": {"running": running, "pid": status.get("pid"), "started_at": status.get("started_at")},
        "stream": stream,
        "last_error": status.get("last_error"),
        "applied": status.get("applied"),
        "mode": status.get("mode"),
        "owned_table": status.get("owned_table") or {"state": "unknown", "since": None},
        "table_modified": status.get("table_modified"),
        "credential": credential,
        "flows": status.get("flows"),
        "updated_at": status.get("updated_at"),
    }


def _since(part: dict[str, Any] | None) -> str:
    return f" since {part['since']}" if part and part.get("since") else ""


def render(doc: dict[str, Any]) -> str:
    daemon = doc["daemon"]
    running = {True: f"running (pid {daemon['pid']})", False: f"not running (last pid {daemon['pid']})"}.get(
        daemon["running"], "has not run yet"
    )
    applied = doc["applied"]
    error = doc["last_error"]
    credential = doc["credential"]
    lines = [
        f"workload:     {doc['workload_id']} ({doc['hostname']})",
        f"gateways:     {', '.join(doc['gateways'])}  pinned {doc['gateway_fingerprint']}",
        f"daemon:       {running}",
        f"stream:       {doc['stream'].get('state')}"
        + (f" to {doc['stream']['gateway']}" if doc["stream"].get("gateway") else "")
        + _since(doc["stream"]),
        "applied:      "
        + (
            f"version {applied['version']} (mode {applied.get('mode')}) at {applied.get('at')}"
            if applied
            else "nothing yet"
        ),
        f"owned table:  {doc['owned_table'].get('state')}{_since(doc['owned_table'])}",
        *_modified_line(doc.get("table_modified")),
        f"credential:   expires {credential.get('expires_at')}, renewal due {credential.get('renewal_due_at')}"
        + (f" ({credential['state']})" if credential.get("state") else ""),
        f"last error:   {error['message']} (at {error.get('at')})" if error else "last error:   none",
    ]
    lines.extend(_flow_lines(doc.get("flows")))
    return "\n".join(lines)


def _modified_line(modified: dict[str, Any] | None) -> list[str]:
    if not modified:
        return []
    restored = f"restored {modified['restored_at']}" if modified.get("restored_at") else "NOT restored"
    return [f"table edited: {modified.get('description')} at {modified.get('modified_at')}, {restored}"]


def _flow_lines(flows: dict[str, Any] | None) -> list[str]:
    if not flows:
        return ["flows:        not reported by this daemon"]
    sources = "; ".join(
        f"{name} {'subscribed' if source['subscribed'] else 'DOWN'}"
        + (f": {source['down_reason']}" if source.get("down_reason") else "")
        + f" (last event {source.get('last_event_at') or 'none'}, overruns {source.get('overruns', 0)})"
        for name, source in sorted(flows.get("sources", {}).items())
    )
    buffer = flows.get("buffer", {})
    return [
        f"flows:        {sources or 'no sources'}",
        f"              open window keys {flows.get('open_window_keys', 0)}; buffer {buffer.get('windows', 0)}"
        f"/{buffer.get('capacity', '?')} windows, {buffer.get('gaps', 0)} gaps;"
        f" last acknowledged window {flows.get('last_acknowledged_window') or 'none'}",
    ]


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True)


def _source_states(flows: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    sources = (flows or {}).get("sources") or {}
    return {name: (source.get("subscribed"), source.get("overruns")) for name, source in sources.items()}


class DaemonStatus:
    """status.json as the running daemon keeps it: rewritten (atomically) at every change."""

    def __init__(
        self, state: StateDir, *, workload_id: str, process_start_id: str, expires_at: str, log
    ) -> None:
        self.state = state
        self.log = log
        self.on_change: Callable[[], None] | None = None  # the metrics textfile writes soon after
        now = now_instant()
        self.data: dict[str, Any] = {
            "pid": os.getpid(),
            "process_start_id": process_start_id,
            "started_at": now,
            "agent_version": __version__,
            "workload_id": workload_id,
            "stream": {"state": "disconnected", "since": now},
            "last_error": None,
            "applied": None,
            "mode": None,
            "owned_table": {"state": "unknown", "since": now},
            "credential": {"expires_at": expires_at, "renewal_due_at": None, "state": None},
        }
        self._carry_over()

    def _carry_over(self) -> None:
        """What a previous process (or the enrolment) wrote that still holds: the table it applied is
        still in the kernel, and the renewal time of the credential we still hold."""
        try:
            previous = self.state.read_status() or {}
        except AgentError:
            return
        if previous.get("workload_id") != self.data["workload_id"]:
            return
        for name in ("applied", "mode"):
            if previous.get(name) is not None:
                self.data[name] = previous[name]
        credential = previous.get("credential")
        if (
            isinstance(credential, dict)
            and credential.get("expires_at") == self.data["credential"]["expires_at"]
        ):
            self.data["credential"]["renewal_due_at"] = credential.get("renewal_due_at")

    @property
    def stream_state(self) -> str:
        return self.data["stream"]["state"]

    @property
    def renewal_due_at(self) -> str | None:
        return self.data["credential"].get("renewal_due_at")

    def save(self, *, notable: bool = True) -> None:
        self.data["updated_at"] = now_instant()
        try:
            self.state.write_status(self.data)
        except AgentError as error:
            self.log("status write failed", error=error.message)
        if notable and self.on_change is not None:
            self.on_change()

    def stream(self, state: str, *, gateway: str | None = None) -> None:
        """`gateway`: the one a connected stream is on."""
        if self.data["stream"]["state"] != state or self.data["stream"].get("gateway") != gateway:
            self.data["stream"] = {"state": state, "since": now_instant(), "gateway": gateway}
            self.save()

    def error(self, message: str) -> None:
        self.data["last_error"] = {"message": message[:2000], "at": now_instant()}
        self.save()

    def credential(self, expires_at: str, renewal_due_at: str, state: str | None = None) -> None:
        state = state or self.data["credential"].get("state")
        self.data["credential"] = {"expires_at": expires_at, "renewal_due_at": renewal_due_at, "state": state}
        self.save()

    def table(self, state: str) -> None:
        self.data["owned_table"] = {"state": state, "since": now_instant()}
        self.save()

    def table_modified(self, modified_at: str, restored_at: str | None, description: str) -> None:
        self.data["table_modified"] = {
            "modified_at": modified_at,
            "restored_at": restored_at,
            "description": description,
        }
        self.save()

    def applied(self, version: str, mode: str) -> None:
        self.data["applied"] = {"version": version, "mode": mode, "at": now_instant()}
        self.data["mode"] = mode
        self.save()

    def flows(self, flows: dict[str, Any]) -> None:
        if self.data.get("flows") != flows:
            before = _source_states(self.data.get("flows"))
            self.data["flows"] = flows
            # A source down, back or overrun is news; its last event's time, moving every few seconds
            # under traffic, is not.
            self.save(notable=_source_states(flows) != before)

    def workload(self, workload_id: str) -> None:
        self.data["workload_id"] = workload_id
        self.save()
