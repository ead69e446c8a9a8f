"""Random secrets with a recognisable prefix, and their digests. Only digests are stored."""

import hashlib
import secrets

OPERATOR_TOKEN_PREFIX = "pal_op_"  # noqa: S105 - a public prefix, not a secret
SESSION_PREFIX = "pal_s_"
DISPLAY_PREFIX_LENGTH = 12


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    # The secrets are 256 random bits: a plain hash is enough, and lookups stay an index probe.
    return hashlib.sha256(secret.encode()).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:DISPLAY_PREFIX_LENGTH]
