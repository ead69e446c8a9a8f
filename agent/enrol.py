"""Enrolment: turn a provisioning bundle into a key, a pinned gateway and a signed credential.

Nothing is written to the state directory until the control plane has answered with a credential
that verifies and names our new key: a refused or failed enrolment leaves an existing enrolment as
it was.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import ssl
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import __version__
from agent.bundle import BundleError, bundle_decode
from agent.credential import (
    CredentialError,
    credential_parse,
    credential_verify,
    format_instant,
    public_key_encode,
)
from agent.errors import AgentError, GatewayUnreachable
from agent.hostinfo import host_addresses, host_name
from agent.protocol import ENROL_PATH, EnrolRequest, EnrolResponse, ProtocolError, retry_after, sign_key_proof
from agent.state import Enrolment, Identity, StateDir
from agent.tls import pin_gateway, pinned_context, split_gateway

MAX_RESPONSE_BYTES = 1024 * 1024
PROBLEM_PREFIX = "urn:service:problem:"
ENROL_RETRIES = 5  # waits of 5 to 15 s each while the control plane's database is away


@dataclass(frozen=True)
class Pinned:
    """A gateway certificate that matched its bundle, and the context that trusts only it."""

    certificate_pem: str
    context: ssl.SSLContext
    gateway: str = ""  # the gateway that presented it: the first of the list that answered


def decode_bundle(bundle_text: str) -> dict[str, Any]:
    try:
        return bundle_decode(bundle_text)
    except BundleError as error:
        raise AgentError(str(error)) from None


def pin(bundle: dict[str, Any], *, timeout: float = 10.0) -> Pinned:
    """The certificate of the first gateway of the bundle that answers, if it is the pinned one. A
    gateway presenting another certificate is refused, not skipped: every gateway of one control plane
    presents the same one, so another is a mistake or an interception the operator must see."""
    unreachable: GatewayUnreachable | None = None
    for gateway in bundle["gateways"]:
        try:
            pem = pin_gateway(gateway, bundle["fingerprint"], timeout=timeout)
        except GatewayUnreachable as error:
            unreachable = error
            continue
        return Pinned(pem, pinned_context(pem), gateway)
    assert unreachable is not None  # noqa: S101 - the bundle lists at least one gateway
    raise _none_answered(bundle["gateways"], unreachable)


def _none_answered(gateways: list[str], last: GatewayUnreachable) -> AgentError:
    if len(gateways) == 1:
        return last
    return GatewayUnreachable(f"none of the {len(gateways)} gateways answered; the last: {last.message}")


def _check_addresses(addresses: list[str]) -> list[str]:
    checked = []
    for text in addresses:
        try:
            checked.append(str(ipaddress.ip_address(text.strip())))
        except ValueError:
            raise AgentError(f"{text!r} is not an IPv4 or IPv6 address") from None
    return checked


def _refusal(status: int, reason: str, content_type: str, body: bytes) -> str:
    """One line from the gateway's problem document (its `detail` first), or from the status line."""
    try:
        problem = json.loads(body) if "json" in content_type else None
    except ValueError:
        problem = None
    if not isinstance(problem, dict) or not isinstance(problem.get("detail") or problem.get("title"), str):
        return f"enrolment refused: the gateway answered HTTP {status} {reason}"
    text = problem.get("detail") or problem.get("title")
    findings = problem.get("errors")
    if isinstance(findings, list):
        notes = [f"{e.get('path', '')}: {e.get('message', '')}" for e in findings[:3] if isinstance(e, dict)]
        if notes:
            text = f"{text} ({'; '.join(notes)})"
    name = problem.get("type", "")
    name = name[len(PROBLEM_PREFIX) :] if isinstance(name, str) and name.startswith(PROBLEM_PREFIX) else ""
    return f"enrolment refused: {text} [HTTP {status}{' ' + name if name else ''}]"


def post_enrolment_any(
    gateways: list[str], context: ssl.SSLContext, request: EnrolRequest, *, timeout: float = 30.0
) -> tuple[str, EnrolResponse]:
    """POST the enrolment to the first of `gateways` that can be reached: (that gateway, its answer)."""
    unreachable: GatewayUnreachable | None = None
    for gateway in gateways:
        try:
            return gateway, post_enrolment(gateway, context, request, timeout=timeout)
        except GatewayUnreachable as error:
            unreachable = error
    assert unreachable is not None  # noqa: S101 - at least one gateway
    raise _none_answered(gateways, unreachable)


def post_enrolment(
    gateway: str,
    context: ssl.SSLContext,
    request: EnrolRequest,
    *,
    timeout: float = 30.0,
    retries: int = ENROL_RETRIES,
) -> EnrolResponse:
    """POST the enrolment; a 503 or 429 with Retry-After (the gateway's database away, or too busy)
    is waited out and tried again, up to `retries` times, before it is the refusal."""
    for _ in range(retries):
        try:
            return _post_enrolment(gateway, context, request, timeout=timeout)
        except _TryAgain as again:
            time.sleep(again.seconds)
    try:
        return _post_enrolment(gateway, context, request, timeout=timeout)
    except _TryAgain as again:
        raise AgentError(again.refusal) from None


class _TryAgain(Exception):
    def __init__(self, seconds: float, refusal: str):
        self.seconds, self.refusal = seconds, refusal


def _post_enrolment(
    gateway: str, context: ssl.SSLContext, request: EnrolRequest, *, timeout: float
) -> EnrolResponse:
    host, port = split_gateway(gateway)
    connection = http.client.HTTPSConnection(host, port, context=context, timeout=timeout)
    try:
        connection.request(
            "POST",
            ENROL_PATH,
            body=json.dumps(request.to_dict()).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        response = connection.getresponse()
        body = response.read(MAX_RESPONSE_BYTES)
    except ssl.SSLCertVerificationError as error:
        raise AgentError(
            f"the gateway {gateway} no longer presents the pinned certificate ({error.verify_message})"
        ) from None
    except ssl.SSLError as error:
        raise AgentError(f"TLS with the gateway {gateway} failed: {error.reason or error}") from None
    except (TimeoutError, OSError) as error:
        reason = getattr(error, "strerror", None) or str(error) or "timed out"
        raise GatewayUnreachable(f"cannot reach the gateway {gateway}: {reason}") from None
    except http.client.HTTPException as error:
        raise AgentError(
            f"the gateway {gateway} sent a broken HTTP response ({type(error).__name__})"
        ) from None
    finally:
        connection.close()
    if response.status != 201:
        refusal = _refusal(response.status, response.reason, response.getheader("Content-Type", ""), body)
        wait = retry_after(response.status, response.getheader("Retry-After"))
        if wait is not None:
            raise _TryAgain(wait, refusal)
        raise AgentError(refusal)
    try:
        return EnrolResponse.from_dict(json.loads(body))
    except ValueError as error:  # ProtocolError is a ValueError too
        reason = error.reason if isinstance(error, ProtocolError) else "it is not JSON"
        raise AgentError(f"the gateway's enrolment response is unusable: {reason}") from None


def _check_credential(response: EnrolResponse, key: Ed25519PrivateKey) -> None:
    try:
        payload = credential_verify(response.credential, response.signing_public_key)
    except CredentialError as error:
        raise AgentError(f"the gateway returned an unusable credential: {error}") from None
    if payload["public_key"] != public_key_encode(key.public_key()):
        raise AgentError("the gateway returned a credential for another key")
    if payload["workload_id"] != response.workload_id:
        raise AgentError("the gateway returned a credential for another workload")


def _current_enrolment(state: StateDir) -> Enrolment | None:
    """The enrolment to sign a re-enrolment with; None when it is unusable (a token must do then)."""
    try:
        return state.load_enrolment()
    except AgentError:
        return None


def _key_proof(current: Enrolment, request: EnrolRequest, fingerprint: str) -> dict:
    """Sign the re-enrolment with the current key: the gateway admits a rotation signed by the key
    the workload is enrolled with, bound to this request, the current credential and this gateway."""
    return sign_key_proof(
        current.key,
        workload_id=current.identity.workload_id,
        serial=credential_parse(current.credential)["serial"],
        public_key=request.public_key,
        hostname=request.hostname,
        addresses=request.addresses,
        signed_at=format_instant(datetime.now(UTC)),
        gateway_fingerprint=fingerprint,
    )


def enrol(
    bundle_text: str | None,
    state_dir: str,
    hostname: str | None = None,
    addresses: list[str] | None = None,
    reenrol: bool = False,
    *,
    pinned: Pinned | None = None,
    timeout: float = 30.0,
) -> Identity:
    """Enrol this host (or re-enrol it with a fresh key when `reenrol`) and store the result.

    A re-enrolment is signed with the current key when the state directory holds a usable enrolment
    (the agent rotating its own key); the bundle's token, if any, goes along, and must be one minted for
    this workload when the key cannot do (e.g. the operator revoked the credential). Without a bundle
    it goes to the gateway of the current enrolment with the key proof alone. `pinned` lets many
    simulated agents share one pinned certificate and context."""
    bundle = decode_bundle(bundle_text) if bundle_text is not None else None
    state = StateDir(state_dir)
    state.create()
    workload_id = None
    current = None
    if state.is_enrolled():
        if not reenrol:
            enrolled = state.load_identity().workload_id
            raise AgentError(
                f"{state.path} is already enrolled as workload {enrolled}; "
                "use --reenrol to enrol it again with a new key"
            )
        workload_id = state.load_identity().workload_id
        current = _current_enrolment(state)
    elif reenrol:
        raise AgentError(f"nothing to re-enrol: {state.path} holds no enrolment; enrol without --reenrol")
    if bundle is None and current is not None:
        identity = current.identity
        gateways = state.load_gateways(identity)
        bundle = {
            "gateways": gateways,
            "gateway": gateways[0],
            "fingerprint": identity.fingerprint,
            "token": "",
        }
        pinned = pinned or Pinned(identity.certificate_pem, pinned_context(identity.certificate_pem))
    elif bundle is None:
        raise AgentError(
            "a bundle is needed: "
            + (
                f"the enrolment in {state.path} is unusable, so its key cannot sign the re-enrolment"
                if reenrol
                else "enrolling needs a provisioning bundle"
            )
        )
    checked = _check_addresses(host_addresses() if addresses is None else addresses)
    pinned = pinned or pin(bundle)
    key = Ed25519PrivateKey.generate()
    request = EnrolRequest(
        token=bundle["token"],
        public_key=public_key_encode(key.public_key()),
        hostname=hostname or host_name(),
        addresses=checked,
        agent_version=__version__,
        workload_id=workload_id,
    )
    if current is not None:
        request = replace(request, key_proof=_key_proof(current, request, bundle["fingerprint"]))
    # The gateway that presented the pinned certificate first, then the rest in their order.
    gateways = list(bundle["gateways"])
    order = (
        [pinned.gateway, *(g for g in gateways if g != pinned.gateway)]
        if pinned.gateway in gateways
        else gateways
    )
    gateway, response = post_enrolment_any(order, pinned.context, request, timeout=timeout)
    _check_credential(response, key)
    identity = Identity(
        workload_id=response.workload_id,
        gateway=gateway,
        fingerprint=bundle["fingerprint"].upper(),
        certificate_pem=pinned.certificate_pem,
        signing_public_key=response.signing_public_key,
        hostname=request.hostname,
        enrolled_at=format_instant(datetime.now(UTC)),
    )
    # The identity last: it is what makes the directory count as enrolled.
    state.write_key(key)
    state.write_credential(response.credential)
    state.write_gateways(gateways, updated_at=identity.enrolled_at)
    state.write_identity(identity)
    state.write_status(
        {
            "workload_id": identity.workload_id,
            "stream": {"state": "disconnected", "since": None},
            "credential": {"expires_at": response.expires_at, "renewal_due_at": response.renewal_due_at},
            "owned_table": {"state": "unknown", "since": None},
            "updated_at": identity.enrolled_at,
        }
    )
    return identity
