"""Django settings for Palisade.

Storage is PostgreSQL when DATABASE_URL is set, else an embedded SQLite file in the data directory.
The channel layer is Redis when REDIS_URL is set, else in-memory (one process).
"""

import os
import secrets
import sys
import tempfile
from pathlib import Path

import dj_database_url

from controlplane.data_dir import data_dir_create, sqlite_file_create

BASE_DIR = Path(__file__).resolve().parent.parent


def _default_data_dir() -> Path:
    if "pytest" in sys.modules:
        # A test run never writes into the operator's real data directory.
        return Path(tempfile.mkdtemp(prefix="palisade-test-data-"))
    xdg = os.environ.get("XDG_DATA_HOME")
    return Path(xdg) / "palisade" if xdg else Path.home() / ".local" / "share" / "palisade"


DATA_DIR = Path(os.environ.get("PALISADE_DATA_DIR") or _default_data_dir()).expanduser().resolve()
data_dir_create(DATA_DIR)


def _secret_key() -> str:
    """Signs cursors. Kept in the data directory so cursors survive restarts; shared through the
    environment when several processes serve one fleet."""
    if os.environ.get("PALISADE_SECRET_KEY"):
        return os.environ["PALISADE_SECRET_KEY"]
    path = DATA_DIR / "secret-key"
    # Processes starting together on one data directory must agree on one key, and never read a key
    # half written: each writes its candidate aside and links it into place, which fails if another
    # process got there first (then that one's key is read).
    for _ in range(3):
        try:
            key = path.read_text().strip()
            if key:
                return key
        except FileNotFoundError:
            pass
        candidate = secrets.token_urlsafe(48)
        aside = path.with_name(f".secret-key.{os.getpid()}.tmp")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(candidate)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(aside, path)
            return candidate
        except FileExistsError:
            continue
        finally:
            os.unlink(aside)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = False
ALLOWED_HOSTS = ["*"]  # a TLS listener on an operator-chosen address; Host is checked by the origin guard

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_htmx",
    "controlplane.auth.apps.OperatorAuthConfig",
    "controlplane.webhooks.apps.WebhooksConfig",
    "controlplane",
    "policy",
    "fleet",
    "flows",
    "flows.policy_drafts.apps.PolicyDraftsConfig",
]

MIDDLEWARE = [
    "controlplane.response_headers.NoStoreMiddleware",
    "controlplane.middleware.AccessLogMiddleware",
    "controlplane.middleware.ListenerRoutingMiddleware",
    "controlplane.middleware.BodySizeLimitMiddleware",
    "controlplane.middleware.CrossOriginGuardMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "controlplane.console.security.ConsoleSecurityHeadersMiddleware",
]
APPEND_SLASH = False

ROOT_URLCONF = "controlplane.urls_operator"
GATEWAY_URLCONF = "controlplane.urls_gateway"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": ["django.template.context_processors.request"],
            "libraries": {"console": "controlplane.console.templatetags.console"},
        },
    }
]

ASGI_APPLICATION = "controlplane.asgi.application"

if os.environ.get("DATABASE_URL"):
    # Persistent connections: HTTP runs on a fixed pool of threads (controlplane/http_threads.py).
    DATABASES = {
        "default": dj_database_url.parse(
            os.environ["DATABASE_URL"], conn_max_age=300, conn_health_checks=True
        )
    }
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # No JIT compilation: it starts above a plan cost that a day's flow rollup passes, and then
        # compiling took 440 ms, four fifths of that query's time. Every query here is short.
        DATABASES["default"].setdefault("OPTIONS", {}).setdefault("options", "-c jit=off")
        # A database host that drops packets would otherwise hold every request thread in connect()
        # with no end; within this it is a 503 (controlplane.outage).
        DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", 5)
else:
    sqlite_file_create(DATA_DIR / "palisade.sqlite3")  # private: it holds the password hash
    DATABASES = {
        "default": {
            # Django's SQLite backend with this process's writers served in the order they ask
            # (controlplane/sqlite): SQLite's own wait let a busy writer starve the others.
            "ENGINE": "controlplane.sqlite",
            "NAME": DATA_DIR / "palisade.sqlite3",
            "CONN_MAX_AGE": 300,
            "OPTIONS": {
                # Writers take the lock up front, so two read-then-write transactions serialise
                # instead of one failing with "database is locked" when it upgrades.
                "transaction_mode": "IMMEDIATE",
                # How long a write waits for its turn (flow reports wait less, below); past it the
                # request is 503 with Retry-After.
                "timeout": float(os.environ.get("PALISADE_SQLITE_WAIT_SECONDS", 20)),
                # WAL: readers never wait for the writer, nor it for them.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
# A flow report waits this long at most for its turn to write to SQLite, then is answered 503 with
# Retry-After (the agent keeps its windows and sends them again): a long write that cannot be split
# (a large policy applied) then delays reports by this much, not by its whole length.
PALISADE_SQLITE_REPORT_WAIT_SECONDS = float(os.environ.get("PALISADE_SQLITE_REPORT_WAIT_SECONDS", 2))
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if os.environ.get("REDIS_URL"):
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "controlplane.channel_layer.BoundedRedisChannelLayer",
            "CONFIG": {"hosts": [os.environ["REDIS_URL"]]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "controlplane.channel_layer.ProcessChannelLayer"}}

LANGUAGE_CODE = "en"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = None  # served from the source tree by whitenoise's finders; no collectstatic step
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = False

# Request bodies: the API never needs more than this; larger bodies get 413 before parsing.
PALISADE_MAX_BODY_BYTES = int(os.environ.get("PALISADE_MAX_BODY_BYTES", 1024 * 1024))
DATA_UPLOAD_MAX_MEMORY_SIZE = PALISADE_MAX_BODY_BYTES
# Query parameters a request may have: room for the largest selection a flow read admits (64 `label`s
# and 1,000 `workload`s, flows/validation.py), so that its own bounds are what refuse one past them;
# more is a malformed request (controlplane/api/errors.py), not Django's 400 page or a 500.
DATA_UPLOAD_MAX_NUMBER_FIELDS = 2000
# An agent's flow report carries whole windows; it alone may be this large.
PALISADE_MAX_FLOW_REPORT_BYTES = int(os.environ.get("PALISADE_MAX_FLOW_REPORT_BYTES", 32 * 1024 * 1024))
# The bytes of request bodies each listener holds at once, from admitting a body until it is answered
# (controlplane/body_gate.py); beyond them a body is 503 with Retry-After. Two of the largest flow
# reports (or eight of the agent's 8 MiB ones); sixteen of the largest API bodies.
PALISADE_GATEWAY_BODY_BUDGET_BYTES = int(
    os.environ.get("PALISADE_GATEWAY_BODY_BUDGET_BYTES", 64 * 1024 * 1024)
)
PALISADE_OPERATOR_BODY_BUDGET_BYTES = int(
    os.environ.get("PALISADE_OPERATOR_BODY_BUDGET_BYTES", 16 * 1024 * 1024)
)
# The pace every body on the gateway listener keeps once admitted, after serve's 10 s grace: a body of
# declared length L is complete within 10 s + L / rate (a 32 MiB report within 34 minutes, the agent's
# 8 MiB within 9); a chunked one is never further behind. 128 kbit/s: agents on slower links need less.
PALISADE_GATEWAY_BODY_MIN_RATE = int(os.environ.get("PALISADE_GATEWAY_BODY_MIN_RATE", 16 * 1024))

# Agents' sync streams one serve process authenticates at once (fleet/admission.py): past it a new
# stream is closed at once with 4503 and `retry after N s`, N spacing the refused out at the rate the
# process completes authentications. 0: no bound. The time an agent takes to answer `hello` counts: with
# 64, simulated agents on a loaded machine answering in seconds held every place, and 2,000 took 190 s
# to connect on two processes idling at a third of a core; with 256, 10,000 failing over took 221 s,
# with 1,024 112 s, none refused (docs/benchmarks.md).
PALISADE_STREAM_AUTHENTICATIONS = int(os.environ.get("PALISADE_STREAM_AUTHENTICATIONS", 1024))

# Heavy requests (render dry-runs, impacts, suggestions, selector previews, flow rollups and reviews,
# the console's exports) run in worker processes of serve (controlplane/heavy_pool.py, docs/operations.md):
# how many, how many more may wait, how long one may run, how large its answer may be, and the workers'
# CPU priority (a nice value: the event loop that holds the agents' streams wins the CPU).
PALISADE_HEAVY_WORKERS = int(os.environ.get("PALISADE_HEAVY_WORKERS", 2))
PALISADE_HEAVY_WAITING = int(os.environ.get("PALISADE_HEAVY_WAITING", 8))
PALISADE_HEAVY_DEADLINE_SECONDS = float(os.environ.get("PALISADE_HEAVY_DEADLINE_SECONDS", 60))
PALISADE_HEAVY_MAX_ANSWER_BYTES = int(os.environ.get("PALISADE_HEAVY_MAX_ANSWER_BYTES", 32 * 1024 * 1024))
PALISADE_HEAVY_NICE = int(os.environ.get("PALISADE_HEAVY_NICE", 10))

# Operator authentication.
PALISADE_SESSION_COOKIE = "palisade_session"
PALISADE_SESSION_LIFETIME_SECONDS = 7 * 24 * 3600
PALISADE_LOGIN_FREE_FAILURES = int(os.environ.get("PALISADE_LOGIN_FREE_FAILURES", 5))
PALISADE_LOGIN_LOCKOUT_SECONDS = int(os.environ.get("PALISADE_LOGIN_LOCKOUT_SECONDS", 30))
# Failed logins from all addresses together: past this many in one window, every login waits for the
# window's end (or `manage.py operator-login-throttle reset`). Many addresses are cheap to come by.
PALISADE_LOGIN_GLOBAL_FAILURES = int(os.environ.get("PALISADE_LOGIN_GLOBAL_FAILURES", 50))
PALISADE_LOGIN_GLOBAL_WINDOW_SECONDS = int(os.environ.get("PALISADE_LOGIN_GLOBAL_WINDOW_SECONDS", 900))
PALISADE_TOKEN_LAST_USED_RESOLUTION_SECONDS = 60

# Agent credentials: lifetime, and how long after expiry a renewal is still admitted.
PALISADE_CREDENTIAL_LIFETIME_SECONDS = int(
    os.environ.get("PALISADE_CREDENTIAL_LIFETIME_SECONDS", 30 * 24 * 3600)
)
PALISADE_CREDENTIAL_GRACE_SECONDS = int(os.environ.get("PALISADE_CREDENTIAL_GRACE_SECONDS", 72 * 3600))

# Flow evidence: windows are one minute unless configured (tests use seconds).
PALISADE_FLOW_WINDOW_SECONDS = int(os.environ.get("PALISADE_FLOW_WINDOW_SECONDS", 60))
# Distinct keys stored one by one: per window, and per report (its windows in order). The keys over
# either bound are summed into the window's aggregate keys (one per decision) and recorded as a
# `keys_aggregated` gap (flows/reports.py; docs/flows.md, "Bounded keys"). The agent's own bound
# (`--flow-window-keys`) and its reports' (agent/flowreporter.py) default to the same numbers.
PALISADE_FLOW_WINDOW_MAX_KEYS = int(os.environ.get("PALISADE_FLOW_WINDOW_MAX_KEYS", 10_000))
PALISADE_FLOW_REPORT_MAX_KEYS = int(os.environ.get("PALISADE_FLOW_REPORT_MAX_KEYS", 20_000))
# Stored flow windows and gaps are removed by serve's housekeeping once this old (`--flow-retention-days`).
PALISADE_FLOW_RETENTION_DAYS = int(os.environ.get("PALISADE_FLOW_RETENTION_DAYS", 30))

# Webhooks (docs/webhooks.md): retries back off exponentially with full jitter from the base to the cap,
# for at least the give-up period; each attempt is bounded; finished deliveries are kept this many days.
# Tests shorten the schedule rather than wait.
PALISADE_WEBHOOK_RETRY_BASE_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_RETRY_BASE_SECONDS", 5))
PALISADE_WEBHOOK_RETRY_CAP_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_RETRY_CAP_SECONDS", 3600))
PALISADE_WEBHOOK_GIVE_UP_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_GIVE_UP_SECONDS", 24 * 3600))
PALISADE_WEBHOOK_TIMEOUT_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_TIMEOUT_SECONDS", 10))
PALISADE_WEBHOOK_SEND_EVERY_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_SEND_EVERY_SECONDS", 1))
PALISADE_WEBHOOK_RETENTION_DAYS = int(os.environ.get("PALISADE_WEBHOOK_RETENTION_DAYS", 7))
# Extra certificate authorities (PEM) the sender trusts beside the system's, e.g. a private CA.
PALISADE_WEBHOOK_CA_FILE = os.environ.get("PALISADE_WEBHOOK_CA_FILE", "")


def _loopback_ports(text: str) -> tuple[int, ...]:
    ports = []
    for item in text.replace(",", " ").split():
        if not item.isdigit() or not 1 <= int(item) <= 65535:
            raise ValueError(f"PALISADE_WEBHOOK_LOOPBACK_PORTS: {item!r} is not a port (1-65535)")
        ports.append(int(item))
    return tuple(ports)


# Where webhooks may go (controlplane/webhooks/destinations.py): loopback receivers only on these
# ports (comma-separated; none by default), private ranges unless "refuse".
PALISADE_WEBHOOK_LOOPBACK_PORTS = _loopback_ports(os.environ.get("PALISADE_WEBHOOK_LOOPBACK_PORTS", ""))
PALISADE_WEBHOOK_PRIVATE_ADDRESSES = os.environ.get("PALISADE_WEBHOOK_PRIVATE_ADDRESSES", "allow")


def _failsafe(text: str) -> tuple[tuple[str, int, int], ...]:
    entries = []
    for item in text.replace(",", " ").split():
        protocol, _, ports = item.partition("/")
        low, _, high = ports.partition("-")
        if protocol not in ("tcp", "udp") or not low.isdigit() or not (high or low).isdigit():
            raise ValueError(
                f"PALISADE_OUTBOUND_FAILSAFE: {item!r} is not tcp/PORT, udp/PORT or udp/FIRST-LAST"
            )
        first, last = int(low), int(high or low)
        if not 1 <= first <= last <= 65535:
            raise ValueError(f"PALISADE_OUTBOUND_FAILSAFE: {item!r} is not a port range within 1-65535")
        entries.append((protocol, first, last))
    return tuple(entries)


# What every output chain admits to any destination before any rule (docs/policy.md, outbound): DNS
# and NTP unless changed; empty ("") admits nothing but the baseline. Marked with the fail-safe flag.
PALISADE_OUTBOUND_FAILSAFE = _failsafe(os.environ.get("PALISADE_OUTBOUND_FAILSAFE", "udp/53,tcp/53,udp/123"))
if PALISADE_WEBHOOK_PRIVATE_ADDRESSES not in ("allow", "refuse"):
    raise ValueError("PALISADE_WEBHOOK_PRIVATE_ADDRESSES must be allow or refuse")
# Each webhook's deliveries are sent by a round of their own, on one of this many threads per serve
# process; a round ends after this many seconds (its webhook's next round queues behind the others).
PALISADE_WEBHOOK_SENDER_THREADS = int(os.environ.get("PALISADE_WEBHOOK_SENDER_THREADS", 8))
PALISADE_WEBHOOK_ROUND_SECONDS = float(os.environ.get("PALISADE_WEBHOOK_ROUND_SECONDS", 30))
# Pending deliveries per webhook beyond this are given up, the oldest first, with the reason recorded.
PALISADE_WEBHOOK_MAX_PENDING = int(os.environ.get("PALISADE_WEBHOOK_MAX_PENDING", 10_000))

# Set by `serve` from its flags; these defaults serve commands run outside `serve`.
PALISADE_SITE_LABEL = os.environ.get("PALISADE_SITE_LABEL", "")
PALISADE_GATEWAY_ADVERTISE = os.environ.get("PALISADE_GATEWAY_ADVERTISE", "")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.auth.authentication.BearerTokenAuthentication",
        "controlplane.auth.authentication.SessionCookieAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["controlplane.api.parsers.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "UNAUTHENTICATED_TOKEN": None,
    "DEFAULT_VERSIONING_CLASS": None,
    "COERCE_DECIMAL_TO_STRING": False,
    "DATETIME_FORMAT": "%Y-%m-%dT%H:%M:%S.%fZ",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Palisade operator API",
    "DESCRIPTION": (
        "The operator API of Palisade, a control plane for host firewalls. Errors are "
        "`application/problem+json` documents whose `type` is `urn:service:problem:<name>`; "
        "see the `Problem` schema for every problem type."
    ),
    "VERSION": "v1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "COMPONENT_SPLIT_REQUEST": True,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "ProblemType": "controlplane.api.schema.PROBLEM_TYPE_CHOICES",
        "ModeEnum": "fleet.choices.Mode.values",
        "RuleActionEnum": "policy.choices.RuleAction.values",
        "DirectionEnum": "flows.choices.Direction.values",
        "ReadDirectionEnum": "flows.choices.READ_DIRECTIONS",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.api.schema.problems_as_problem_json",
    ],
}

LOGGING = {
    "version": 1,
    # get_asgi_application() re-applies this; True would silence daphne's own error logging.
    "disable_existing_loggers": False,
    "formatters": {"line": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "line"}},
    "root": {"handlers": ["stderr"], "level": os.environ.get("PALISADE_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        "django.server": {"level": "ERROR"},
        "daphne": {"level": "WARNING"},
        "daphne.server": {"level": "INFO"},
    },
}
