"""Problem types: the one catalogue of every error a client of the operator API can meet.

Domain code raises `Problem` (or `ValidationFailed`); the API turns them into
`application/problem+json` documents (controlplane/api/errors.py) and the command line into a one-line
error with a non-zero exit. Nothing here depends on the web framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROBLEM_URN = "urn:service:problem:"


@dataclass(frozen=True)
class ProblemType:
    status: int
    title: str
    description: str


PROBLEM_TYPES: dict[str, ProblemType] = {
    "malformed-request": ProblemType(
        400, "Malformed request", "The body is not valid JSON, or a header is malformed."
    ),
    "unauthenticated": ProblemType(
        401,
        "Unauthenticated",
        "No valid credential: missing, malformed, revoked or expired; or a wrong password.",
    ),
    "cross-origin": ProblemType(
        403,
        "Cross-origin request refused",
        "A non-read request that a browser marked as coming from another origin.",
    ),
    "enrolment-refused": ProblemType(
        403,
        "Enrolment refused",
        "The agent gateway refused an enrolment the provisioning token does not allow: re-enrolling an existing workload needs a token minted for that workload (or a request signed with its current key), and a token minted for a workload enrols nothing else.",
    ),
    "credential-revoked": ProblemType(
        403,
        "Credential revoked",
        "The agent gateway refused a workload whose credential the operator revoked: it reports, renews and re-enrols with its key no more; only a re-enrolment with a provisioning token minted for it brings it back.",
    ),
    "not-found": ProblemType(404, "Not found", "No such resource or path on this listener."),
    "method-not-allowed": ProblemType(
        405, "Method not allowed", "The resource does not support this method."
    ),
    "not-acceptable": ProblemType(406, "Not acceptable", "The API only produces JSON."),
    "in-use": ProblemType(
        409,
        "Object in use",
        "The object is referenced and cannot be deleted; `referenced_by` names the referencing rules.",
    ),
    "address-taken": ProblemType(
        409,
        "Address taken",
        "The agent gateway refused an enrolment whose addresses another active workload (credential not revoked) holds: an address belongs to one workload; `held_by` names each address and its workload.",
    ),
    "workload-offline": ProblemType(
        409,
        "Workload offline",
        "The workload was last recorded as offline; `last_heard_from` says when it was last heard from (null: never connected).",
    ),
    "no-confirmation-deadline": ProblemType(
        409,
        "Nothing to confirm",
        "A confirmation of a mode change made without a deadline (`confirm_within_seconds`): it stands as it is, and nothing was confirmed.",
    ),
    "confirmation-deadline-passed": ProblemType(
        409,
        "Confirmation deadline passed",
        "A confirmation of a mode change after its deadline: the system puts, or has put, its workloads back; `confirm_by` is the deadline, `reverted_by` the system's mode change that put them back (null: not yet, within seconds).",
    ),
    "precondition-failed": ProblemType(
        412,
        "Precondition failed",
        "The If-Match version has moved; `current_version` carries the current one.",
    ),
    "payload-too-large": ProblemType(413, "Payload too large", "The request body exceeds `max_bytes`."),
    "unsupported-media-type": ProblemType(
        415, "Unsupported media type", "Request bodies must be application/json."
    ),
    "validation": ProblemType(
        422, "Validation failed", "The request fails validation; `errors` holds one finding per field to fix."
    ),
    "answer-too-large": ProblemType(
        422,
        "Answer too large",
        "The answer to a heavy request (a rollup, review, suggestion, impact, dry-run, preview or export) would exceed `max_bytes`; nothing was sent; narrow its range or selection.",
    ),
    "header-too-large": ProblemType(
        431, "Request header fields too large", "The request line or the headers exceed `max_bytes`."
    ),
    "precondition-required": ProblemType(
        428, "Precondition required", "Updates and deletes require If-Match carrying the object's version."
    ),
    "rate-limited": ProblemType(
        429,
        "Too many requests",
        "Too many failed logins from this client or from all clients together, or too many heavy requests (render dry-runs, impacts, suggestions, selector previews, flow rollups and reviews, exports) running and waiting at once, or (agent gateway) another flow report of the same workload being received; retry after `retry_after` seconds.",
    ),
    "internal": ProblemType(500, "Internal error", "The service failed; the error is logged on the host."),
    "service-unavailable": ProblemType(
        503,
        "Service unavailable",
        "The service cannot answer now (its database is unreachable, the listener holds as many request bodies as it admits at once, or it is stopping); nothing was changed; retry after `retry_after` seconds (also the Retry-After header).",
    ),
    "deadline-exceeded": ProblemType(
        504,
        "Deadline exceeded",
        "A heavy request ran past `deadline_seconds` and was stopped; nothing was changed; narrow its range or selection.",
    ),
}


class Problem(Exception):
    """A failure with a stable problem name; `extensions` become extra members of the document."""

    def __init__(
        self, name: str, detail: str = "", *, headers: dict[str, str] | None = None, **extensions: Any
    ):
        if name not in PROBLEM_TYPES:
            raise ValueError(f"unknown problem type {name!r}")
        super().__init__(detail or PROBLEM_TYPES[name].title)
        self.name = name
        self.detail = detail or PROBLEM_TYPES[name].title
        self.headers = headers or {}
        self.extensions = extensions

    @property
    def status(self) -> int:
        return PROBLEM_TYPES[self.name].status

    def document(self, *, instance: str | None = None) -> dict[str, Any]:
        kind = PROBLEM_TYPES[self.name]
        doc: dict[str, Any] = {
            "type": PROBLEM_URN + self.name,
            "title": kind.title,
            "status": kind.status,
            "detail": self.detail,
        }
        if instance:
            doc["instance"] = instance
        doc.update(self.extensions)
        return doc


@dataclass(frozen=True)
class Finding:
    """One field to fix: `path` is a JSON Pointer into the request body (`?name` for a query parameter)."""

    path: str
    rule: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "rule": self.rule, "message": self.message}


class ValidationFailed(Problem):
    MAX_FINDINGS = 50  # enough to fix a body by; a body of 10,000 bad items does not echo them all

    def __init__(self, findings: list[Finding]):
        findings = list(findings)
        self.findings = findings[: self.MAX_FINDINGS]
        summary = "; ".join(f"{f.path or '/'}: {f.message}" for f in self.findings[:3])
        more = f" (+{len(findings) - 3} more)" if len(findings) > 3 else ""
        super().__init__("validation", summary + more, errors=[f.as_dict() for f in self.findings])


def pointer(*parts: str | int) -> str:
    """A JSON Pointer from path parts, escaping `~` and `/` as RFC 6901 says."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
