"""Where webhooks may go, as a careless operator (or a hostile one) tries it: every refused URL is
judged by the validation's answer alone (nothing here lets the sender run against anything but this
host's loopback), and at delivery the host is resolved and checked again, so a name that now resolves
to a refused address (DNS rebinding; here `localhost` and the settings stand in for a name we control)
is refused before any connection."""

import http.server
import threading
from contextlib import contextmanager

import pytest

from controlplane.auth.actor import CLI_ACTOR
from controlplane.models import AuditEvent
from controlplane.webhooks.destinations import Refused, url_check
from controlplane.webhooks.models import Webhook, WebhookAttempt
from controlplane.webhooks.sender import http_post, webhook_deliveries_send
from controlplane.webhooks.services import webhook_create
from tests.support.helpers import assert_problem

LISTED = 8765  # the loopback port the tests list as a receiver's

REFUSED = [
    # loopback, on a port not listed, however it is written
    ("http://127.0.0.1:22/", "url-loopback-port"),
    ("https://127.0.0.1:6379/", "url-loopback-port"),
    ("https://127.0.0.1/", "url-loopback-port"),
    ("http://127.9.9.9:5432/", "url-loopback-port"),
    ("http://[::1]:22/", "url-loopback-port"),
    ("https://[::ffff:127.0.0.1]:22/", "url-loopback-port"),
    ("https://[::ffff:7f00:1]:22/", "url-loopback-port"),
    ("https://[0:0:0:0:0:ffff:127.0.0.1]:22/", "url-loopback-port"),
    ("https://[64:ff9b::127.0.0.1]:22/", "url-loopback-port"),  # NAT64 carrying loopback
    ("http://localhost:22/", "url-loopback-port"),
    ("http://LOCALHOST.:22/", "url-loopback-port"),
    ("https://127.0.0.1.:22/", "url-loopback-port"),
    # numbers a resolver reads as addresses
    ("http://2130706433/", "url"),
    ("http://0177.0.0.1/", "url"),
    ("http://0x7f.0.0.1/", "url"),
    ("http://0x7f000001/", "url"),
    ("http://127.1/", "url"),
    ("https://017700000001:8765/", "url"),
    # credentials, with an address to trick a reader of the URL
    ("https://a@127.0.0.1/", "url"),
    ("https://127.0.0.1@192.0.2.10/", "url"),
    ("https://user:pass@192.0.2.10/", "url"),
    ("https://192.0.2.10@127.0.0.1:8765/", "url"),
    ("https://192.0.2.10 /", "url"),
    ("https://192.0.2.10/\r\nX: y", "unsafe-character"),
    ("https://[::1/", "url"),
    ("https://[fe80::1%25eth0]/", "url-address"),
    # cloud metadata services, by address and by name, whatever the scheme
    ("https://169.254.169.254/latest/meta-data/", "url-address"),
    ("http://169.254.169.254/", "url-address"),
    ("https://[::ffff:169.254.169.254]/", "url-address"),
    ("https://[64:ff9b::a9fe:a9fe]/", "url-address"),
    ("https://[2002:a9fe:a9fe::1]/", "url-address"),  # 6to4 carrying it
    ("https://[fd00:ec2::254]/latest/meta-data/", "url-address"),
    ("https://100.100.100.200/latest/meta-data/", "url-address"),
    ("https://168.63.129.16/", "url-address"),
    ("https://192.0.0.192/", "url-address"),
    ("https://metadata.google.internal/computeMetadata/v1/", "url-address"),
    ("http://metadata.google.internal./", "url-address"),
    ("https://METADATA.GOOG/", "url-address"),
    ("https://metadata/", "url-address"),
    ("https://instance-data/", "url-address"),
    # addresses of no one host, and reserved ones
    ("https://0.0.0.0/", "url-address"),
    ("https://0.0.0.0:8765/", "url-address"),
    ("https://[::]/", "url-address"),
    ("https://169.254.1.1/", "url-address"),
    ("https://[fe80::1]/", "url-address"),
    ("https://224.0.0.1/", "url-address"),
    ("https://[ff02::1]/", "url-address"),
    ("https://255.255.255.255/", "url-address"),
    ("https://240.0.0.1/", "url-address"),
    ("https://[::127.0.0.1]/", "url-address"),
    ("https://[fec0::1]/", "url-address"),
    # plain http anywhere but a listed loopback port
    ("http://192.0.2.10/", "url-scheme"),
    ("http://10.0.0.1/", "url-scheme"),
    ("http://[2001:db8::1]/", "url-scheme"),
    ("ftp://192.0.2.10/", "url"),
    ("https:///nohost", "url"),
    ("https://192.0.2.10/#frag", "url"),
]


@pytest.fixture(autouse=True)
def listed(settings):
    settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (LISTED,)


@pytest.mark.parametrize("url, rule", REFUSED, ids=[u for u, _ in REFUSED])
def test_a_refused_url_is_a_finding_and_nothing_is_written(api, url, rule):
    answer = api.post("/api/v1/webhooks", {"url": url, "events": ["workload.degraded"]}, format="json")
    assert_problem(answer, 422, "validation")
    assert [(e["path"], e["rule"]) for e in answer.json()["errors"]] == [("/url", rule)]
    assert not Webhook.objects.exists() and not AuditEvent.objects.filter(object_type="webhook").exists()


ADMITTED = [
    "https://192.0.2.10/hook",
    "https://[2001:db8::10]:8443/hook",
    "https://10.0.0.1/hook",  # private ranges: admitted by default
    "https://172.16.5.4/hook",
    "https://100.64.0.9/hook",
    "https://[fd12:3456::1]/hook",
    f"http://127.0.0.1:{LISTED}/hook",
    f"https://127.0.0.1:{LISTED}/hook",
    f"http://[::1]:{LISTED}/hook",
    f"http://localhost:{LISTED}/hook",
    f"https://[::ffff:127.0.0.1]:{LISTED}/hook",
]


@pytest.mark.parametrize("url", ADMITTED)
def test_https_to_other_hosts_and_anything_to_a_listed_loopback_port_are_admitted(api, url):
    answer = api.post("/api/v1/webhooks", {"url": url, "events": ["workload.degraded"]}, format="json")
    assert answer.status_code == 201, answer.content


@pytest.mark.parametrize("url", ADMITTED[2:6])
def test_private_ranges_are_refused_when_the_setting_says_so(settings, url):
    settings.PALISADE_WEBHOOK_PRIVATE_ADDRESSES = "refuse"
    with pytest.raises(Refused) as refused:
        url_check(url, lookup_seconds=1)
    assert refused.value.rule == "url-address" and "private" in refused.value.reason


def test_the_finding_says_why_in_our_words():
    with pytest.raises(Refused) as refused:
        url_check("http://localhost:22/x", lookup_seconds=1)
    assert refused.value.reason == (
        "localhost resolves to 127.0.0.1: loopback, on port 22, which PALISADE_WEBHOOK_LOOPBACK_PORTS does not "
        "list; a receiver on this host is admitted only on a port listed there."
    )


@contextmanager
def loopback_receiver():
    """A plain http receiver on loopback recording the paths it was asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            asked.append(self.path)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_name_resolving_to_a_refused_address_at_delivery_is_refused_before_connecting(db, settings):
    with loopback_receiver() as (port, asked):
        settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (port,)
        created = webhook_create(
            actor=CLI_ACTOR, data={"url": f"http://localhost:{port}/hook", "events": ["webhook.created"]}
        )
        # What localhost resolves to is no longer admitted (as a name now resolving to loopback would be).
        settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = ()
        assert webhook_deliveries_send() == 1
        assert asked == []  # never connected
        (attempt,) = WebhookAttempt.objects.filter(webhook_id=created.webhook.id)
        assert attempt.status_code is None and attempt.outcome == "retrying"
        assert attempt.error.startswith(f"refused: localhost resolves to 127.0.0.1: loopback, on port {port}")
        settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = (port,)  # admitted again: delivered at its retry
        WebhookAttempt.objects.all().delete()
        from controlplane.webhooks.models import WebhookDelivery

        WebhookDelivery.objects.update(next_attempt_at=attempt.at)
        assert webhook_deliveries_send() == 1
    assert asked == ["/hook"]


@pytest.mark.parametrize("form", ["127.0.0.1", "[::ffff:127.0.0.1]", "localhost", "0x7f.1"])
def test_a_stored_url_refused_now_is_refused_at_delivery_without_connecting(settings, form):
    """URLs stored before the rules (or with settings since changed) are judged at each delivery."""
    with loopback_receiver() as (port, asked):
        settings.PALISADE_WEBHOOK_LOOPBACK_PORTS = ()
        answer = http_post(f"http://{form}:{port}/hook", body=b"{}", headers={}, timeout=2)
    assert asked == [] and answer.status_code is None and answer.error.startswith("refused: ")
