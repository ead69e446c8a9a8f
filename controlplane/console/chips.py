"""The spec's chips and console texts, derived from a workload as the API returns it (a dict), never
from a model: the console shows what the API says, in the words the spec gives."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from controlplane import clock
from controlplane.text import visible

# Tones map to the chip's colour: "bad" needs action, "warn" needs attention, "info" is a fact.
BAD, WARN, INFO, GOOD = "bad", "warn", "info", "good"


@dataclass(frozen=True)
class Chip:
    label: str
    tone: str
    detail: str = ""


def parse_instant(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def duration_text(seconds: float) -> str:
    """'45 s', '12 min', '3 h 5 min', '2 d 4 h': the two largest units, for a person reading a chip."""
    seconds = int(abs(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes} min"
    if seconds < 86400:
        rest = minutes % 60
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    rest = hours % 24
    return f"{days} d {rest} h" if rest else f"{days} d"


def countdown_text(seconds: int) -> str:
    """'9 s', '4 min 12 s', '1 h 0 min 5 s': every unit down to the second, for a deadline counted down."""
    seconds = max(int(seconds), 0)
    hours, minutes, rest = seconds // 3600, seconds // 60 % 60, seconds % 60
    if hours:
        return f"{hours} h {minutes} min {rest} s"
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _ago(instant: datetime, now: datetime) -> str:
    return f"{duration_text((now - instant).total_seconds())} ago"


def workload_chips(workload: dict, now: datetime | None = None) -> list[Chip]:
    now = now or clock.now()
    sync, health = workload["sync"], workload["health"]
    chips: list[Chip] = []
    removed = health["owned_table"]["state"] == "absent"
    if removed:
        chips.append(Chip("Enforcement removed on host", BAD, "the owned table is gone; resend a snapshot"))
    # A removed table enforces nothing: a green "synced" beside it would read as all being well.
    chips.extend(chip for chip in _sync_chips(sync, health, now) if not (removed and chip.tone == GOOD))
    chips.extend(_table_modified_chips(health["owned_table"], now))
    chips.extend(_credential_chips(health["credential"], now))
    skew = health.get("clock_skew")
    if skew:
        offset = skew["offset_seconds"]
        direction = "ahead" if offset > 0 else "behind"
        chips.append(Chip(f"Clock skew {duration_text(offset)} {direction}", WARN, f"seen {skew['seen_at']}"))
    gap = health.get("evidence_gap")
    if gap:
        chips.append(
            Chip(
                f"Evidence gap {short_instant(gap['start'])} – {short_instant(gap['end'])}",
                WARN,
                f"{gap['kind']}: {gap['start']} to {gap['end']}",
            )
        )
    return chips


def _sync_chips(sync: dict, health: dict, now: datetime) -> list[Chip]:
    state = sync["state"]
    if state == "offline":
        if health.get("telemetry_live"):
            return [Chip("Reconnecting", WARN, "the sync stream is down; flow reports still arrive")]
        heard = parse_instant(sync.get("last_heard_from"))
        text = "never connected" if heard is None else f"last contact {_ago(heard, now)}"
        return [Chip(f"offline: {text}", BAD)]
    if state == "degraded":
        error = visible(sync.get("error") or "applying the latest version failed", keep="\n\t")  # the agent's
        return [Chip(f"degraded: {error}", BAD)]
    if state == "pending":
        return [Chip(f"pending: {short_version(sync.get('pending_version'))} not yet applied", INFO)]
    return [Chip("synced", GOOD)]


TABLE_EDIT_SHOWN_SECONDS = 24 * 3600  # a chip says what needs looking at now; the page keeps the last edit


def _table_modified_chips(table: dict, now: datetime) -> list[Chip]:
    """A hand edit of the owned table in the last day: put right by the agent (a warning: someone on the
    host edits the firewall) or not (enforcement is not the policy's)."""
    modified = parse_instant(table.get("modified_at"))
    if modified is None or (now - modified).total_seconds() > TABLE_EDIT_SHOWN_SECONDS:
        return []
    detail = visible(table.get("modification") or "")
    if table.get("restored_at"):
        return [Chip(f"Table edited on host {_ago(modified, now)}, restored", WARN, detail)]
    return [Chip(f"Table edited on host {_ago(modified, now)}, NOT restored", BAD, detail)]


def _credential_chips(credential: dict, now: datetime) -> list[Chip]:
    chips = []
    state = credential["state"]
    revoked = credential.get("revoked")
    if revoked:
        # Overrides the lifetime state: nothing renews or reports until a consented re-enrolment.
        why = f": {revoked['reason']}" if revoked.get("reason") else ""
        return [Chip("Credential revoked", BAD, f"revoked at {revoked['at']}{why}")]
    if state == "expired":
        chips.append(Chip("Credential expired", BAD, f"expired at {credential['expires_at']}"))
    elif state == "renewal-failed":
        chips.append(
            Chip("renewal failed, retrying", WARN, visible(credential.get("last_error") or "", keep="\n\t"))
        )
    else:
        due = parse_instant(credential.get("renewal_due_at"))
        if due is not None and due <= now:
            chips.append(Chip("renewal due now", INFO))
        elif due is not None:
            chips.append(Chip(f"renewal due in {duration_text((due - now).total_seconds())}", INFO))
    late = credential.get("last_late_renewal_late_by_seconds")
    if credential.get("last_late_renewal") and late is not None:
        chips.append(
            Chip(f"renewed {duration_text(late)} late", INFO, f"at {credential['last_late_renewal']}")
        )
    return chips


def short_version(version: str | None) -> str:
    if not version:
        return "none"
    return visible(version.split(":", 1)[-1][:12])  # an applied version is the agent's text


def short_instant(text: str | None) -> str:
    instant = parse_instant(text)
    return instant.strftime("%Y-%m-%d %H:%M:%S") if instant else "—"
