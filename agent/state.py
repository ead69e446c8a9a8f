"""The agent's state directory (`--state-dir`, default /var/lib/palisade-agent, mode 0700):

    key.pem         the Ed25519 private key (0600); it never leaves the host
    credential      the control plane's signed credential (0600), replaced at each renewal
    identity.json   workload id, gateway, pinned fingerprint and certificate, control-plane signing key
    gateways.json   every gateway of the control plane, in the order to try them (from the bundle, then
                    as the gateway pushes it): {"gateways": ["HOST:PORT", ...], "updated_at": ...}
    status.json     what the daemon last saw, for `palisade-agent status`

Every file is written to a temporary name and renamed, so a reader (or a crash) only ever sees a
whole old file or a whole new one.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.bundle import BundleError, gateways_check
from agent.credential import CredentialError, credential_verify, public_key_encode
from agent.errors import AgentError, EnrolmentNeeded
from agent.flowreport import report_headers

DEFAULT_STATE_DIR = "/var/lib/palisade-agent"
KEY_FILE = "key.pem"
CREDENTIAL_FILE = "credential"
IDENTITY_FILE = "identity.json"
STATUS_FILE = "status.json"
GATEWAYS_FILE = "gateways.json"
ENROL_HINT = "run 'palisade-agent enrol --bundle ...' first"


@dataclass(frozen=True)
class Identity:
    workload_id: str
    gateway: str  # HOST:PORT or [IPV6]:PORT, from the enrolment bundle
    fingerprint: str  # SHA-256 of the gateway certificate, upper-case colon hex
    certificate_pem: str  # the pinned gateway certificate: the only trust anchor
    signing_public_key: str  # the control plane's credential-signing key, base64 raw Ed25519
    hostname: str
    enrolled_at: str

    @classmethod
    def from_dict(cls, data: Any) -> Identity:
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or not all(isinstance(data.get(name), str) for name in names):
            raise ValueError(f"it must be a JSON object with the string fields {', '.join(names)}")
        return cls(**{name: data[name] for name in names})


@dataclass(frozen=True)
class Enrolment:
    identity: Identity
    key: Ed25519PrivateKey
    credential: str
    expires_at: str

    def flow_report_headers(self, body: bytes) -> dict[str, str]:
        """The headers of a flow report of `body`: this workload, its credential, the body signed."""
        return report_headers(
            body,
            key=self.key,
            workload_id=self.identity.workload_id,
            credential=self.credential,
            gateway_fingerprint=self.identity.fingerprint,
        )


def write_atomically(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Create a temporary file with `mode` from the start (a key is never readable by others, not
    even for a moment), fill it, and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may only have removed bits; make the mode exact
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


class StateDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def file(self, name: str) -> Path:
        return self.path / name

    # --- the directory itself ---

    def create(self) -> None:
        """Make the directory (0700) if needed; tighten an existing one that others could read."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.stat().st_mode & 0o077:
                os.chmod(self.path, 0o700)
        except OSError as error:
            raise AgentError(f"cannot create the state directory {self.path}: {_reason(error)}") from None
        self.check_usable(write=True)

    def check_usable(self, *, write: bool = False) -> None:
        what = "write to" if write else "read"
        try:
            is_dir = stat.S_ISDIR(os.stat(self.path).st_mode)
        except FileNotFoundError:
            raise EnrolmentNeeded(
                f"not enrolled: the state directory {self.path} does not exist; {ENROL_HINT}"
            ) from None
        except OSError as error:  # e.g. a parent directory we may not enter
            raise AgentError(
                f"cannot {what} the state directory {self.path}: {_reason(error)} (run as root?)"
            ) from None
        if not is_dir:
            raise AgentError(f"the state directory {self.path} is not a directory")
        if not os.access(self.path, os.R_OK | os.X_OK | (os.W_OK if write else 0)):
            raise AgentError(
                f"cannot {what} the state directory {self.path}: Permission denied (run as root?)"
            )

    def is_enrolled(self) -> bool:
        return self.file(IDENTITY_FILE).exists()

    # --- reading ---

    def _read(self, name: str) -> bytes:
        self.check_usable()
        path = self.file(name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise EnrolmentNeeded(f"not enrolled: {path} does not exist; {ENROL_HINT}") from None
        except OSError as error:
            raise AgentError(f"cannot read {path}: {_reason(error)}") from None

    def load_identity(self) -> Identity:
        raw = self._read(IDENTITY_FILE)
        try:
            return Identity.from_dict(json.loads(raw))
        except ValueError as error:
            raise AgentError(f"{self.file(IDENTITY_FILE)} is damaged ({error}); enrol again") from None

    def load_key(self) -> Ed25519PrivateKey:
        raw = self._read(KEY_FILE)
        try:
            key = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError):
            key = None
        if not isinstance(key, Ed25519PrivateKey):
            raise AgentError(f"{self.file(KEY_FILE)} is not an unencrypted Ed25519 private key; enrol again")
        return key

    def load_credential(self) -> str:
        try:
            return self._read(CREDENTIAL_FILE).decode().strip()
        except UnicodeDecodeError:
            raise AgentError(f"{self.file(CREDENTIAL_FILE)} is damaged; enrol again") from None

    def load_enrolment(self) -> Enrolment:
        """Identity, key and credential, checked to belong together: the credential verifies with the
        control plane's key and names our key."""
        identity, key, credential = self.load_identity(), self.load_key(), self.load_credential()
        try:
            payload = credential_verify(credential, identity.signing_public_key)
        except CredentialError as error:
            raise AgentError(f"{self.file(CREDENTIAL_FILE)}: {error}; enrol again") from None
        if payload["public_key"] != public_key_encode(key.public_key()):
            raise AgentError(f"the stored credential does not name the key in {self.path}; enrol again")
        return Enrolment(identity, key, credential, payload["expires_at"])

    def load_gateways(self, identity: Identity) -> list[str]:
        """The gateways to try, in order: gateways.json, or (enrolled before there were several, or the
        file damaged) the gateway of the enrolment alone."""
        try:
            data = json.loads(self.file(GATEWAYS_FILE).read_bytes())
            return gateways_check(data.get("gateways") if isinstance(data, dict) else None)
        except (OSError, ValueError, BundleError):
            return [identity.gateway]

    def write_gateways(self, gateways: list[str], *, updated_at: str) -> None:
        data = {"gateways": list(gateways), "updated_at": updated_at}
        self._write(GATEWAYS_FILE, json.dumps(data, indent=2).encode() + b"\n")

    def identity_stamp(self) -> int | None:
        """Changes when identity.json is replaced (a re-enrolment)."""
        try:
            return self.file(IDENTITY_FILE).stat().st_mtime_ns
        except OSError:
            return None

    def read_status(self) -> dict[str, Any] | None:
        """What the daemon last wrote, or None when it never ran."""
        self.check_usable()
        try:
            data = json.loads(self.file(STATUS_FILE).read_bytes())
        except FileNotFoundError:
            return None
        except OSError as error:
            raise AgentError(f"cannot read {self.file(STATUS_FILE)}: {_reason(error)}") from None
        except ValueError:
            raise AgentError(f"{self.file(STATUS_FILE)} is not JSON") from None
        if not isinstance(data, dict):
            raise AgentError(f"{self.file(STATUS_FILE)} is not a JSON object")
        return data

    # --- writing ---

    def _write(self, name: str, data: bytes, *, durable: bool = True) -> None:
        try:
            write_atomically(self.file(name), data, durable=durable)
        except OSError as error:
            raise AgentError(f"cannot write {self.file(name)}: {_reason(error)}") from None

    def write_key(self, key: Ed25519PrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self._write(KEY_FILE, pem)

    def write_credential(self, credential: str) -> None:
        self._write(CREDENTIAL_FILE, credential.encode() + b"\n")

    def write_identity(self, identity: Identity) -> None:
        self._write(IDENTITY_FILE, json.dumps(asdict(identity), indent=2).encode() + b"\n")

    def write_status(self, status: dict[str, Any]) -> None:
        # Rewritten at every event: durability is not worth an fsync each time.
        self._write(STATUS_FILE, json.dumps(status, indent=2, sort_keys=True).encode() + b"\n", durable=False)
