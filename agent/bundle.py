"""The enrolment bundle: the one string an operator pastes into an agent to enrol it.

    palisade-enrol-v1:<base64url, no padding, of compact JSON>
    {"gateway":"<host:port>","fingerprint":"<SHA-256 of the gateway certificate, colon hex>","token":"pal_pt_..."}

    palisade-enrol-v2:<the same encoding>
    {"gateways":["<host:port>", ...],"fingerprint":"...","token":"pal_pt_..."}

`gateway` is where the agent enrols and streams; `gateways` (v2) is the ordered list of the control
plane's gateways, which all present the one certificate `fingerprint` pins (no CA involved); `token` is
the provisioning token. Each version takes exactly its three fields. The control plane writes v1 while it
advertises one gateway, so agents that only read v1 still enrol; v2 when it advertises several.

Standard library only: the control plane encodes bundles with this module and the agent decodes them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

BUNDLE_PREFIX = "palisade-enrol-v1:"
BUNDLE_PREFIX_V2 = "palisade-enrol-v2:"
PROVISIONING_TOKEN_PREFIX = "pal_pt_"  # noqa: S105 - a public prefix, not a secret
FIELDS = ("gateway", "fingerprint", "token")
FIELDS_V2 = ("gateways", "fingerprint", "token")
MAX_GATEWAYS = 16

_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
_FINGERPRINT = re.compile(r"[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){31}")
_TOKEN = re.compile(re.escape(PROVISIONING_TOKEN_PREFIX) + r"[A-Za-z0-9_-]{16,200}")
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")
_IPV6_BRACKETED = re.compile(r"\[[0-9A-Fa-f:.]+\]")


class BundleError(ValueError):
    """A string that is not a usable enrolment bundle; the message is one line for the operator."""


def _check_gateway(gateway: object) -> str:
    if not isinstance(gateway, str):
        raise BundleError("the enrolment bundle's gateway must be a string HOST:PORT")
    host, colon, port = gateway.rpartition(":")
    if (
        not colon
        or not (port.isascii() and port.isdigit())  # isdigit alone admits "²", which int refuses
        or not 1 <= int(port) <= 65535
        or not (_HOST.fullmatch(host) or _IPV6_BRACKETED.fullmatch(host))
    ):
        raise BundleError(f"the enrolment bundle's gateway {gateway!r} is not HOST:PORT or [IPV6]:PORT")
    return gateway


def gateways_check(gateways: object, *, what: str = "the enrolment bundle's gateways") -> list[str]:
    """An ordered, non-empty list of distinct HOST:PORT addresses (BundleError otherwise)."""
    if not isinstance(gateways, list) or not gateways:
        raise BundleError(f"{what} must be a non-empty list of HOST:PORT")
    if len(gateways) > MAX_GATEWAYS:
        raise BundleError(f"{what} lists {len(gateways)} addresses; at most {MAX_GATEWAYS}")
    checked = [_check_gateway(gateway) for gateway in gateways]
    if len(set(checked)) != len(checked):
        raise BundleError(f"{what} lists an address twice")
    return checked


def _check_fingerprint(fingerprint: object) -> str:
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise BundleError(
            "the enrolment bundle's fingerprint is not a SHA-256 fingerprint (32 colon-separated hex bytes)"
        )
    return fingerprint.upper()


def _check_token(token: object) -> str:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise BundleError(
            f"the enrolment bundle's token is not a provisioning token ({PROVISIONING_TOKEN_PREFIX}...)"
        )
    return token


def bundle_encode(
    *, fingerprint: str, token: str, gateways: list[str] | None = None, gateway: str | None = None
) -> str:
    """The bundle for these values (`gateways`, or one `gateway`), each checked as `bundle_decode` would
    check it: v1 for one gateway (every agent version reads it), v2 for several."""
    checked = gateways_check(list(gateways) if gateways is not None else [gateway])
    fields: dict[str, object] = {"fingerprint": _check_fingerprint(fingerprint), "token": _check_token(token)}
    if len(checked) == 1:
        prefix, fields = BUNDLE_PREFIX, {"gateway": checked[0], **fields}
    else:
        prefix, fields = BUNDLE_PREFIX_V2, {"gateways": checked, **fields}
    raw = json.dumps(fields, separators=(",", ":")).encode()
    return prefix + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def bundle_decode(text: object) -> dict[str, Any]:
    """The bundle's fields `{"gateways", "gateway", "fingerprint", "token"}` (`gateway` is the first of
    `gateways`, which a v1 bundle lists alone); BundleError for anything else.

    Whitespace anywhere is ignored (a bundle wrapped or indented when it was pasted still reads),
    and so is `=` padding; everything else must be exactly as `bundle_encode` writes it.
    """
    if not isinstance(text, str):
        raise BundleError("the enrolment bundle must be text")
    compact = "".join(text.split())
    if not compact:
        raise BundleError("the enrolment bundle is empty")
    prefix = next((p for p in (BUNDLE_PREFIX, BUNDLE_PREFIX_V2) if compact.startswith(p)), None)
    if prefix is None:
        if compact.startswith(PROVISIONING_TOKEN_PREFIX):
            raise BundleError(
                "this is a bare provisioning token, not an enrolment bundle; "
                f"give the whole {BUNDLE_PREFIX}... string printed when the token was minted"
            )
        if compact.startswith("palisade-enrol-"):
            version = compact.split(":", 1)[0][len("palisade-enrol-") :]
            raise BundleError(
                f"unsupported enrolment bundle version {version!r}; this agent reads "
                f"{BUNDLE_PREFIX}... and {BUNDLE_PREFIX_V2}..."
            )
        raise BundleError(f"not an enrolment bundle: it must start with {BUNDLE_PREFIX}")
    body = compact[len(prefix) :].rstrip("=")
    if not body:
        raise BundleError("the enrolment bundle is truncated: nothing follows the prefix")
    if not _BASE64URL.fullmatch(body) or len(body) % 4 == 1:
        raise BundleError("the enrolment bundle is damaged: the part after the prefix is not base64url")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        fields = json.loads(raw.decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BundleError("the enrolment bundle is damaged or truncated: its content is not JSON") from None
    if not isinstance(fields, dict):
        raise BundleError("the enrolment bundle is damaged: its content is not a JSON object")
    expected = FIELDS if prefix == BUNDLE_PREFIX else FIELDS_V2
    missing = [name for name in expected if name not in fields]
    if missing:
        raise BundleError(f"the enrolment bundle lacks {', '.join(missing)}")
    unknown = sorted(str(name) for name in fields if name not in expected)
    if unknown:
        raise BundleError(
            f"the enrolment bundle has unknown fields {', '.join(unknown)}; is it from a newer version?"
        )
    if prefix == BUNDLE_PREFIX:
        gateways = [_check_gateway(fields["gateway"])]
    else:
        gateways = gateways_check(fields["gateways"])
    return {
        "gateways": gateways,
        "gateway": gateways[0],
        "fingerprint": _check_fingerprint(fields["fingerprint"]),
        "token": _check_token(fields["token"]),
    }
