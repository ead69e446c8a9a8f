"""The console in headless Chromium (Debian's package, driven by Playwright) against the real serve over
TLS, with simulated agents, scripted agents holding each state, and real flow reports.

Every page is checked for requests to another origin and for JavaScript errors, and screenshotted
into tests/console/screenshots/ (a CI artifact, ignored by git).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from agent.enrol import enrol
from agent.flowbuffer import FlowBuffer
from agent.flowreport import report_body
from agent.flowwindow import FlowKey, Windows
from agent.state import StateDir
from tests.support.flow_reports import post_flow_report
from tests.support.requirements import require
from tests.support.scripted_agent import ScriptedStreams
from tests.support.serve_process import REPO, Site, terminate

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
PASSWORD = "console test password"
SIMULATED = 3
EXPIRING_LIFETIME = 4  # seconds: the credentials of the workloads meant to be expired


def _require_chromium():
    if not Path(CHROMIUM).exists():
        require(False, "needs Debian's chromium (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        require(False, "needs the playwright package (pip install playwright)")


class Lab:
    """The ids and processes the tests look at."""

    def __init__(self, root: Path):
        self.root = root
        self.ids: dict[str, str] = {}


def _flow_report(enrolment, buffer_dir: Path, *, skew: float = 0.0, with_gap: bool) -> bytes:
    now = time.time()
    start = math.floor(now / 60) * 60 - 120  # two closed windows before this minute
    windows = Windows(length=60, max_keys=100, accounting=True)
    allowed = FlowKey("10.200.0.1", "tcp", 443, "allowed", None)
    would_block = FlowKey("192.0.2.9", "tcp", 22, "would_block", None)
    for at in (start + 1, start + 2, start + 3, start + 61, start + 62):
        windows.connection_opened(allowed, at)
    for at in (start + 5, start + 65, start + 66):
        windows.connection_opened(would_block, at)
    closed, gaps = windows.close_due(start + 120, "v-console")
    buffer_dir.mkdir()
    # With room for one window the first overflows: a buffer_overflow gap over its range.
    buffer = FlowBuffer(buffer_dir, max_records=1 if with_gap else 10)
    buffer.add(closed, gaps)
    pending_windows, pending_gaps = buffer.pending()
    return report_body(
        pending_windows, pending_gaps, now=now + skew, process_start_id="p-console", uptime_seconds=300.0,
        window_seconds=60,
    )  # fmt: skip


def _post_report(serve, enrolment, body: bytes) -> None:
    answer = post_flow_report(serve, enrolment, body)
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _require_chromium()
    root = tmp_path_factory.mktemp("console")
    lab = Lab(root)
    with Site.fresh(root / "data", migrated=True) as site:
        site.set_operator_password(PASSWORD)
        # First serve: short credentials, for the two workloads that must be expired.
        short = site.serve(
            env={"REDIS_URL": "", "PALISADE_CREDENTIAL_LIFETIME_SECONDS": str(EXPIRING_LIFETIME)}
        )
        listen = {"operator_listen": short.operator_listen, "gateway_listen": short.gateway_listen}
        http = short.client("operator", headers={"Authorization": f"Bearer {short.mint_operator_token()}"})
        bundle = http.post(
            "/api/v1/provisioning-tokens", json={"description": "console", "max_uses": 20}
        ).json()
        http.close()
        for index, name in enumerate(("expired-1", "late-1")):  # an address holds one workload
            lab.ids[name] = enrol(
                bundle["bundle"], str(root / name), hostname=name, addresses=[f"10.9.0.{index + 1}"]
            ).workload_id
        expiring_since = time.monotonic()
        assert short.stop() == 0
        # Webhooks to a loopback port are admitted only on the ports listed (the webhook test's).
        serve = site.serve(env={"REDIS_URL": "", "PALISADE_WEBHOOK_LOOPBACK_PORTS": "9"}, **listen)
        lab.serve = serve
        http = serve.client("operator", headers={"Authorization": f"Bearer {serve.mint_operator_token()}"})
        lab.http = http
        for index, name in enumerate(
            ("never-1", "degraded-1", "removed-1", "failing-1", "pending-1", "web-1", "skewed-1")
        ):
            lab.ids[name] = enrol(
                bundle["bundle"], str(root / name), hostname=name, addresses=[f"10.9.1.{index + 1}"]
            ).workload_id
        lab_token = http.post(
            "/api/v1/provisioning-tokens",
            json={"description": "lab", "max_uses": SIMULATED, "labels": {"env": "lab"}},
        ).json()
        (root / "lab.bundle").write_text(lab_token["bundle"])
        simulator = subprocess.Popen(
            [sys.executable, "-m", "agent", "simulate", "--bundle-file", str(root / "lab.bundle"),
             "--count", str(SIMULATED), "--state-root", str(root / "sim"), "--heartbeat-seconds", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, start_new_session=True,
        )  # fmt: skip
        streams = ScriptedStreams()
        try:
            load = {name: StateDir(root / name).load_enrolment() for name in lab.ids}
            for name, role in (("degraded-1", "degraded"), ("removed-1", "removed"),
                               ("failing-1", "renewal-failed"), ("pending-1", "pending")):  # fmt: skip
                streams.hold(load[name], role=role)
            time.sleep(max(0.0, EXPIRING_LIFETIME + 1 - (time.monotonic() - expiring_since)))
            streams.hold(load["late-1"], role="renew-late")
            _post_report(
                serve, load["web-1"], _flow_report(load["web-1"], root / "buffer-web", with_gap=True)
            )
            _post_report(
                serve,
                load["skewed-1"],
                _flow_report(load["skewed-1"], root / "buffer-skewed", skew=900.0, with_gap=False),
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                items = http.get("/api/v1/workloads", params={"label": "env=lab"}).json()["items"]
                if len(items) == SIMULATED and all(w["sync"]["state"] == "synced" for w in items):
                    break
                time.sleep(0.3)
            else:
                raise AssertionError(f"simulated agents not synced: {items}")
            lab.simulated = [w["id"] for w in items]
            yield lab
        finally:
            streams.close()
            terminate(simulator)
            http.close()
            assert "Traceback" not in serve.stderr_text(), serve.stderr_text()[-4000:]


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def context(browser, lab):
    context = browser.new_context(
        ignore_https_errors=True, accept_downloads=True, viewport={"width": 1280, "height": 900}
    )
    yield context
    context.close()


# Installed in every document before its own scripts: a Content-Security-Policy violation (an inline
# style or script refused) is reported to the test at once, whatever Chromium logs about it.
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (event) => {
  window.palisadeViolation(`${event.violatedDirective} refused ${event.blockedURI || "inline"} at `
    + `${event.sourceFile}:${event.lineNumber}:${event.columnNumber} (${event.sample})`);
});
"""


class Watched:
    """A page that fails the test on a request to another origin, a JavaScript error, any console
    message of level error, or any Content-Security-Policy violation."""

    def __init__(self, page, origin: str):
        self.page, self.origin, self.problems = page, origin, []
        page.on("request", self._request)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on("console", self._console)
        page.expose_function("palisadeViolation", lambda text: self.problems.append(f"CSP violation: {text}"))
        page.add_init_script(REPORT_VIOLATIONS)
        page.on("dialog", self._dialog)

    def _dialog(self, dialog) -> None:
        # The console asks on a page of its own, never in a dialog.
        self.problems.append(f"unexpected dialog: {dialog.message}")
        dialog.dismiss()

    def _console(self, message) -> None:
        if message.type == "error":
            self.problems.append(f"console error: {message.text} at {message.location}")

    def _request(self, request):
        parts = urlsplit(request.url)
        if parts.scheme in ("data", "blob", "about"):
            return
        if f"{parts.scheme}://{parts.netloc}" != self.origin:
            self.problems.append(f"request to another origin: {request.url}")

    def goto(self, path: str):
        self.page.goto(self.origin + path)
        return self.page

    def shot(self, name: str) -> None:
        # caret="initial": hiding the caret injects a <style>, which the page's CSP rightly refuses.
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True, caret="initial")

    def check(self) -> None:
        assert not self.problems, self.problems


@pytest.fixture(scope="module")
def logged_in(context, lab):
    page = Watched(context.new_page(), lab.serve.operator_url)
    page.goto("/flows")
    assert "/login" in page.page.url
    page.shot("login")
    page.page.get_by_label("Operator password").fill("wrong password")
    page.page.get_by_role("button", name="Log in").click()
    page.page.locator(".problem").wait_for()
    page.page.get_by_label("Operator password").fill(PASSWORD)
    page.page.get_by_role("button", name="Log in").click()
    page.page.wait_for_url(re.compile(r"/flows"))
    yield page
    page.check()


def row(page, hostname: str):
    return page.locator(f'tr[data-workload="{hostname}"]')


def test_every_chip_appears_for_a_workload_in_that_state(logged_in, lab):
    page = logged_in.goto("/")
    expectations = {
        "never-1": "offline: never connected",
        "expired-1": "Credential expired",
        "late-1": "last contact",  # it renewed (late) over a renew-only stream: contact, not "never"
        "degraded-1": "degraded: Error: Could not process rule",
        "removed-1": "Enforcement removed on host",
        "failing-1": "renewal failed, retrying",
        "pending-1": "not yet applied",
        "web-1": "Reconnecting",
        "skewed-1": "Clock skew",
    }
    for hostname, chip in expectations.items():
        assert chip in row(page, hostname).inner_text(), (hostname, row(page, hostname).inner_text())
    assert re.search(r"renewed \d+ s late", row(page, "late-1").inner_text())
    assert "Evidence gap" in row(page, "web-1").inner_text()
    assert re.search(r"Clock skew 1[45] min ahead", row(page, "skewed-1").inner_text())
    assert "renewal due in" in row(page, "never-1").inner_text()
    assert "synced" in page.locator("tr", has_text="sim-").first.inner_text()
    assert page.locator('[data-count="removed"]').inner_text() == "1"
    assert page.locator('[data-count="total"]').inner_text() == str(len(lab.ids) + SIMULATED)
    # Fleet order: degraded and enforcement-removed first.
    first_two = {page.locator("tbody tr").nth(i).get_attribute("data-workload") for i in (0, 1)}
    assert first_two == {"degraded-1", "removed-1"}
    logged_in.shot("fleet")
    logged_in.check()


def test_filters_and_paging(logged_in, lab):
    page = logged_in.goto("/?removed=true")
    assert page.locator("tbody tr").count() == 1 and row(page, "removed-1").count() == 1
    page = logged_in.goto("/")
    page.get_by_label("Add a label requirement").fill("env=lab")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"label=env%3Dlab"))
    assert page.locator("tbody tr").count() == SIMULATED
    page = logged_in.goto("/?limit=5")
    first = [page.locator("tbody tr").nth(i).get_attribute("data-workload") for i in range(5)]
    page.get_by_role("link", name="Next page").click()
    page.wait_for_url(re.compile(r"cursor="))
    second = [page.locator("tbody tr").nth(i).get_attribute("data-workload") for i in range(5)]
    assert not set(first) & set(second)
    logged_in.check()


def test_the_fleet_refreshes_itself(logged_in, lab):
    page = logged_in.goto("/")
    assert "Clock skew" in row(page, "skewed-1").inner_text()
    lab.http.put(
        f"/api/v1/workloads/{lab.ids['skewed-1']}/labels",
        json={"labels": {"role": "refreshed"}},
        headers={
            "If-Match": '"'
            + lab.http.get(f"/api/v1/workloads/{lab.ids['skewed-1']}/labels").json()["version"]
            + '"'
        },
    )
    row(page, "skewed-1").get_by_text("role=refreshed").wait_for(timeout=15_000)
    logged_in.check()


def test_a_label_edit_that_meets_a_conflict(logged_in, context, lab):
    url = f"/workloads/{lab.ids['never-1']}"
    mine = logged_in.goto(url)
    other = Watched(context.new_page(), lab.serve.operator_url)
    other.goto(url)
    other.page.get_by_label("One key=value per line").fill("team=blue")
    other.page.get_by_role("button", name="Save labels").click()
    other.page.get_by_text("Labels saved").wait_for()
    mine.get_by_label("One key=value per line").fill("team=red")
    mine.get_by_role("button", name="Save labels").click()
    conflict = mine.locator('[data-problem="precondition-failed"]')
    conflict.wait_for()
    assert "Changed since you opened it" in conflict.inner_text() and "team=blue" in conflict.inner_text()
    logged_in.shot("workload-label-conflict")
    other.page.close()
    other.check()
    logged_in.check()


def test_resend_on_an_offline_workload_says_when_it_was_last_heard_from(logged_in, lab):
    page = logged_in.goto(f"/workloads/{lab.ids['never-1']}")
    page.get_by_role("button", name="Resend snapshot").click()
    refusal = page.locator('[data-problem="workload-offline"]')
    refusal.wait_for()
    assert "never connected" in refusal.inner_text()
    logged_in.check()


def test_resend_on_a_connected_workload_moves_the_last_snapshot_sent(logged_in, lab):
    url = f"/workloads/{lab.simulated[0]}"
    page = logged_in.goto(url)
    before = page.locator('[data-fact="last-snapshot"]').inner_text()
    time.sleep(1.1)  # the fact is shown to the second
    page.get_by_role("button", name="Resend snapshot").click()
    page.get_by_text("Directive sent").wait_for()
    deadline = time.monotonic() + 20
    while logged_in.goto(url).locator('[data-fact="last-snapshot"]').inner_text() == before:
        assert time.monotonic() < deadline, "the last snapshot sent did not move"
        time.sleep(0.5)
    logged_in.check()


def test_the_workload_page_plots_its_flows_and_lists_its_gaps(logged_in, lab):
    page = logged_in.goto(f"/workloads/{lab.ids['web-1']}?range=1h")
    assert page.locator("svg rect.bar").count() >= 2
    # The buffer held one of the two windows: the first was dropped (its range is the gap).
    assert page.locator('[data-total="would_block"]').inner_text() == "2"
    assert page.locator('[data-total="allowed"]').inner_text() == "2"
    assert page.locator('tr[data-gap="buffer_overflow"]').count() == 1
    assert "Incomplete" in page.locator(".coverage").inner_text()
    logged_in.shot("workload")
    logged_in.check()


def test_authoring_a_rule_with_a_validation_error_then_fixing_it(logged_in, lab):
    page = logged_in.goto("/policy/rulesets/new")
    page.get_by_label("Name", exact=True).fill("lab-web")
    page.get_by_label("Scope").fill("env=lab")
    page.locator("#scope-preview").get_by_text(f"{SIMULATED} workloads match").wait_for()
    page.get_by_role("button", name="Create ruleset").click()
    page.wait_for_url(re.compile(r"/policy/rulesets/[0-9a-f-]+$"))
    page.get_by_role("link", name="Add a rule").click()
    page.get_by_label("Sources").fill("role in (")
    page.get_by_label("Services").fill("tcp/443")
    page.get_by_role("button", name="Save rule").click()
    errors = page.locator("#sources-errors")
    errors.wait_for()
    assert errors.inner_text().strip()
    logged_in.shot("rule-validation-error")
    page.get_by_label("Sources").fill("env=lab")
    page.locator("#sources-preview").get_by_text(f"{SIMULATED} workloads match").wait_for()
    page.get_by_role("button", name="Dry-run").click()
    page.locator("#dryrun-h").wait_for()
    assert "would change" in page.locator("#dryrun-h").inner_text()
    logged_in.shot("rule-dryrun")
    page.get_by_role("button", name="Save rule").click()
    page.wait_for_url(re.compile(r"/policy/rulesets/[0-9a-f-]+$"))
    assert "env=lab" in page.locator("table").inner_text()
    logged_in.shot("ruleset")
    logged_in.goto("/policy")
    logged_in.shot("policy")
    logged_in.check()


def test_a_mode_change_to_enforced_needs_confirmation_of_what_fails_then_converges(logged_in, lab):
    page = logged_in.goto("/mode-changes")
    page.get_by_label("Label requirements").fill("env=lab")
    page.get_by_label("enforced").check()
    page.get_by_role("button", name="Preview").click()
    page.locator('[data-verdict="fail"]').wait_for()
    assert f"{SIMULATED} workloads selected" in page.locator("#mode-change").inner_text()
    page.get_by_role("button", name="Change mode to enforced").click()
    confirm = page.locator(".confirm")
    confirm.wait_for()
    assert "not in simulation for the whole range" in confirm.inner_text()
    logged_in.shot("mode-change-confirm")
    page.get_by_label(re.compile("I enforce despite")).check()
    page.get_by_role("button", name="Change mode to enforced").click()
    page.locator("[data-intent]").wait_for()
    page.locator(f'[data-converged="{SIMULATED}"][data-selected="{SIMULATED}"]').wait_for(timeout=30_000)
    logged_in.shot("mode-change-converged")
    modes = {
        w["mode"] for w in lab.http.get("/api/v1/workloads", params={"label": "env=lab"}).json()["items"]
    }
    assert modes == {"enforced"}
    logged_in.check()


def test_a_mode_change_with_confirmation_counts_down_until_confirmed(logged_in, lab):
    page = logged_in.goto("/mode-changes")
    page.get_by_label("Workload ids").fill(lab.ids["never-1"])
    page.get_by_label("simulation").check()
    page.get_by_label(re.compile("with confirmation")).check()
    page.get_by_label("Seconds to confirm within").fill("300")
    page.get_by_role("button", name="Change mode to simulation").click()
    block = page.locator('#mode-change .notice + [data-confirmation="awaiting"]')
    block.wait_for()
    counted = block.locator("[data-seconds-left]")
    first = int(counted.get_attribute("data-seconds-left"))
    assert 290 <= first <= 300, first
    # The block polls every second: the count goes down without a reload.
    page.wait_for_function(
        "first => Number(document.querySelector('#mode-change [data-seconds-left]')"
        ".getAttribute('data-seconds-left')) < first",
        arg=first,
        timeout=10_000,
    )
    logged_in.shot("mode-change-countdown")
    page.locator("#mode-change").get_by_role("button", name="Confirm").click()
    page.locator('#mode-change [data-confirmation="confirmed"]').wait_for()
    assert "stands" in page.locator('#mode-change [data-confirmation="confirmed"]').inner_text()
    logged_in.shot("mode-change-confirmed")
    changes = lab.http.get("/api/v1/mode-changes", params={"limit": 1}).json()["items"]
    assert changes[0]["confirmation"] == "confirmed" and changes[0]["selection"] == {
        "workload_ids": [lab.ids["never-1"]]
    }
    logged_in.check()


def test_the_review_page_states_its_reasons(logged_in, lab):
    page = logged_in.goto(f"/review?range=1h&workloads={lab.ids['web-1']}")
    assert page.locator('[data-verdict="fail"]').count() == 1
    reasons = page.locator(".reasons").inner_text()
    assert "would-block" in reasons and "evidence gap" in reasons and "offline" in reasons
    logged_in.shot("review")
    logged_in.check()


def test_flows_plot_rule_hits_and_csv_export(logged_in, lab):
    page = logged_in.goto(f"/flows?range=1h&workloads={lab.ids['web-1']}&group_by=peer&group_by=service")
    assert page.locator("svg rect.bar").count() >= 2
    assert "192.0.2.9" in page.locator("table.rollup").inner_text()
    assert page.locator('[data-unused="unknown"]').count() == 1  # a gap: unused rules cannot be known
    logged_in.shot("flows")
    with page.expect_download() as download:
        page.locator("a", has_text="Export CSV").first.click()
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    counts = {(r["peer"], r["protocol"], r["port"]): int(r["connection_count"]) for r in rows}
    assert counts == {("10.200.0.1", "tcp", "443"): 2, ("192.0.2.9", "tcp", "22"): 2}
    logged_in.check()


def asked(page, *names: str):
    """The confirmation step is on screen and names each of `names`."""
    question = page.locator("[data-confirm]")
    question.wait_for()
    assert question.is_visible()
    said = question.inner_text()
    for name in names:
        assert name in said, (name, said)
    return question


def test_minting_shows_the_secret_once_and_revoking_asks_first(logged_in, lab):
    page = logged_in.goto("/tokens")
    page.get_by_label("Name").fill("ci pipeline")
    page.get_by_role("button", name="Mint operator token").click()
    secret = page.locator("#secret").input_value()
    assert secret.startswith("pal_op_")
    page.get_by_role("button", name="Copy").click()
    page.get_by_text("Copied.").wait_for()
    logged_in.shot("tokens-minted")
    page = logged_in.goto("/tokens")
    assert secret not in page.content()
    bearer = {"Authorization": f"Bearer {secret}"}
    page.locator("tr", has_text="ci pipeline").get_by_role("link", name="Revoke").click()
    asked(
        page,
        f"Revoke operator token {secret[:12]}",
        "ci pipeline",
        "Scripts that use it stop working at once",
    )
    logged_in.shot("token-revoke-confirm")
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(r"/tokens$"))
    assert lab.http.get("/api/v1/me", headers=bearer).status_code == 200  # cancelled: it still works
    page.locator("tr", has_text="ci pipeline").get_by_role("link", name="Revoke").click()
    page.get_by_role("button", name="Revoke the token").click()
    page.get_by_text("Revoked.").wait_for()
    assert "revoked" in page.locator("tr", has_text="ci pipeline").inner_text()
    assert lab.http.get("/api/v1/me", headers=bearer).status_code == 401
    logged_in.check()


def test_a_webhook_is_created_with_its_secret_shown_once_and_deleted_only_when_confirmed(logged_in, lab):
    receiver = "http://127.0.0.1:9/browser-hook"  # loopback, on a port the lab's serve lists
    page = logged_in.goto("/about")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Webhooks").click()
    page.wait_for_url(re.compile(r"/webhooks$"))
    page.locator("#wh-url").fill(receiver)
    page.get_by_label("Description").fill("browser pager")
    page.get_by_role("button", name="Create webhook").click()  # no event chosen: the API's finding
    page.locator("#events-errors").wait_for()
    assert "at least one event type" in page.locator("#events-errors").inner_text()
    assert page.locator("#wh-url").input_value() == receiver
    for event in ("workload.offline", "webhook.deleted"):
        page.locator(f'input[name="events"][value="{event}"]').check()
    page.get_by_role("button", name="Create webhook").click()
    page.get_by_text("Webhook signing secret: copy it now, it is not shown again").wait_for()
    secret = page.locator("#secret").input_value()
    assert secret.startswith("whsec_")
    page.get_by_role("button", name="Copy").click()
    page.get_by_text("Copied.").wait_for()
    logged_in.shot("webhook-created")
    page = logged_in.goto("/webhooks")
    assert secret not in page.content()
    row = page.locator("tr", has_text="browser pager")
    assert receiver in row.inner_text() and "workload.offline" in row.inner_text()
    webhook_id = row.get_attribute("data-webhook")

    def exists() -> bool:
        return lab.http.get(f"/api/v1/webhooks/{webhook_id}").status_code == 200

    row.get_by_role("link", name="Delete").click()
    asked(page, f"Delete the webhook to {receiver}", "browser pager", "delivery history")
    logged_in.shot("webhook-delete-confirm")
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(rf"/webhooks/{webhook_id}$"))
    page.get_by_text("Recent delivery attempts").wait_for()
    assert exists()  # dismissed: nothing changed
    page.get_by_role("link", name="Delete").click()
    page.get_by_role("button", name="Delete the webhook").click()
    page.get_by_text("Deleted.").wait_for()
    assert page.locator("tr", has_text="browser pager").count() == 0
    assert not exists()
    logged_in.check()


def test_revoking_a_provisioning_token_asks_first(logged_in, lab):
    minted = lab.http.post(
        "/api/v1/provisioning-tokens", json={"description": "rack 9", "max_uses": 2}
    ).json()["record"]

    def state() -> str:
        listing = lab.http.get("/api/v1/provisioning-tokens", params={"limit": 500}).json()["items"]
        return next(t["state"] for t in listing if t["id"] == minted["id"])

    page = logged_in.goto("/tokens")
    page.locator(f'tr[data-token="{minted["prefix"]}"]').get_by_role("link", name="Revoke").click()
    asked(page, f"Revoke provisioning token {minted['prefix']}", "rack 9", "used 0 of 2 times",
          "Agents can no longer enrol with it")  # fmt: skip
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(r"/tokens$"))
    assert state() == "active"
    page.locator(f'tr[data-token="{minted["prefix"]}"]').get_by_role("link", name="Revoke").click()
    page.get_by_role("button", name="Revoke the token").click()
    page.get_by_text("Revoked.").wait_for()
    assert state() == "revoked"
    logged_in.check()


def test_deleting_a_rule_then_its_ruleset_asks_first_naming_what_goes(logged_in, lab):
    ruleset = lab.http.post(
        "/api/v1/rulesets",
        json={"name": "doomed", "scope": "env=lab", "rules": [
            {"description": "web", "sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]},
            {"description": "dns", "sources": [{"any": True}], "services": [{"protocol": "udp", "port": 53}]},
        ]},
    ).json()  # fmt: skip
    url = f"/api/v1/rulesets/{ruleset['id']}"
    number = ruleset["rules"][1]["number"]  # a rule's number is for its lifetime, across rulesets
    page = logged_in.goto(f"/policy/rulesets/{ruleset['id']}")
    page.locator("tr", has_text="dns").get_by_role("link", name=f"Delete rule {number}").click()
    asked(
        page,
        f"Delete rule {number} (dns) of ruleset “doomed”",
        "udp/53",
        f"protects {SIMULATED} workloads now",
    )
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(r"/policy/rulesets/[0-9a-f-]+$"))
    assert len(lab.http.get(url).json()["rules"]) == 2
    page.locator("tr", has_text="dns").get_by_role("link", name=f"Delete rule {number}").click()
    page.get_by_role("button", name="Delete the rule").click()
    page.wait_for_url(re.compile(r"/policy/rulesets/[0-9a-f-]+$"))
    assert [r["description"] for r in lab.http.get(url).json()["rules"]] == ["web"]

    page.get_by_role("link", name="Delete this ruleset").click()
    asked(page, "Delete ruleset “doomed”: its 1 rule go", f"it protects {SIMULATED} workloads now")
    logged_in.shot("ruleset-delete-confirm")
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(r"/policy/rulesets/[0-9a-f-]+$"))
    assert lab.http.get(url).status_code == 200  # cancelled: still there, rules and all
    page.get_by_role("link", name="Delete this ruleset").click()
    page.get_by_role("button", name="Delete the ruleset and its rules").click()
    page.wait_for_url(re.compile(r"/policy$"))
    assert lab.http.get(url).status_code == 404
    logged_in.check()


def test_deleting_a_service_and_an_address_group_asks_first(logged_in, lab):
    made = {
        "services": lab.http.post("/api/v1/services", json={"name": "doomed-svc", "entries": [
            {"protocol": "tcp", "port": 8443}]}).json(),
        "address-groups": lab.http.post("/api/v1/address-groups", json={"name": "doomed-net",
                                        "members": ["198.51.100.0/24"]}).json(),
    }  # fmt: skip
    for kind, named in (
        ("services", ("doomed-svc", "tcp/8443")),
        ("address-groups", ("doomed-net", "198.51.100.0/24")),
    ):
        url = f"/api/v1/{kind}/{made[kind]['id']}"
        page = logged_in.goto(f"/policy/{kind}/{made[kind]['id']}")
        page.get_by_role("link", name="Delete").click()
        asked(page, *named)
        page.get_by_role("link", name="Cancel").click()
        page.wait_for_url(re.compile(rf"/policy/{kind}/[0-9a-f-]+$"))
        assert lab.http.get(url).status_code == 200
        page.get_by_role("link", name="Delete").click()
        page.get_by_role("button", name="Delete the").click()
        page.wait_for_url(re.compile(r"/policy$"))
        assert lab.http.get(url).status_code == 404
    # One a rule uses: confirmed, the API refuses it, and the refusal names the rule (no failed load).
    used = lab.http.post(
        "/api/v1/services", json={"name": "used-svc", "entries": [{"protocol": "tcp", "port": 9}]}
    ).json()
    user = lab.http.post("/api/v1/rulesets", json={"name": "user", "scope": "role=none", "rules": [
        {"sources": [{"any": True}], "services": [{"service": used["id"]}]}]}).json()  # fmt: skip
    page = logged_in.goto(f"/policy/services/{used['id']}/delete")
    page.get_by_role("button", name="Delete the service").click()
    refusal = page.locator('[data-problem="in-use"]')
    refusal.wait_for()
    assert "Still referenced" in refusal.inner_text() and "user" in refusal.inner_text()
    assert lab.http.get(f"/api/v1/services/{used['id']}").status_code == 200
    assert lab.http.delete(
        f"/api/v1/rulesets/{user['id']}", headers={"If-Match": f'"{user["version"]}"'}
    ).status_code in (200, 204)
    logged_in.check()


def test_a_label_edit_in_a_resized_field_applies_no_inline_style(logged_in, lab):
    """A person who drags the field's corner gives it an inline height; htmx's settle step copied
    `style` onto the new field with setAttribute, which the page's CSP refuses."""
    page = logged_in.goto(f"/workloads/{lab.ids['pending-1']}")
    field = page.get_by_label("One key=value per line")
    field.evaluate("element => { element.style.height = '240px'; }")  # what the resize handle does
    field.fill("team=green")
    page.get_by_role("button", name="Save labels").click()
    page.get_by_text("Labels saved").wait_for()
    page.wait_for_timeout(200)  # the settle step runs after the swap
    logged_in.check()


def test_about_and_a_phone_width(logged_in, context, lab):
    page = logged_in.goto("/about")
    assert page.locator('[data-fact="version"]').inner_text()
    page.keyboard.press("Tab")  # by keyboard: the first stop skips to the content, the next ones are the menu
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Fleet"
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/$"))
    page = logged_in.goto("/about")
    logged_in.shot("about")
    page.set_viewport_size({"width": 390, "height": 844})
    logged_in.goto("/")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390 + 1, f"the fleet page scrolls sideways on a phone: {width}px"
    logged_in.shot("fleet-phone")
    page.set_viewport_size({"width": 1280, "height": 900})
    logged_in.check()


def test_revoking_a_workloads_credential_asks_first(logged_in, lab):
    workload_id = lab.ids["never-1"]

    def revoked():
        return lab.http.get(f"/api/v1/workloads/{workload_id}").json()["health"]["credential"]["revoked"]

    page = logged_in.goto(f"/workloads/{workload_id}")
    page.get_by_label("Reason (shown on the workload)").fill("host lost")
    page.get_by_role("button", name="Revoke credential").click()
    asked(page, "Revoke the credential of never-1", "host lost", "minted for it")
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(re.compile(rf"/workloads/{workload_id}$"))
    assert revoked() is None  # cancelled: nothing changed
    page.get_by_label("Reason (shown on the workload)").fill("host lost")
    page.get_by_role("button", name="Revoke credential").click()
    page.get_by_role("button", name="Revoke the credential").click()
    page.get_by_text("Credential revoked at").wait_for()
    assert revoked()["reason"] == "host lost"
    logged_in.check()


def test_suggesting_rules_from_the_flows_then_saving_them_and_going_to_simulation(logged_in, lab):
    """web-1's stored flows hold a would-block key (192.0.2.9 to tcp/22) and a gap: the proposal names
    the gap, saved it creates the address group and the ruleset, and the link prefills simulation."""
    page = logged_in.goto(f"/workloads/{lab.ids['web-1']}")
    page.get_by_label("One key=value per line").fill("app=web")
    page.get_by_role("button", name="Save labels").click()
    page.get_by_text("Labels saved").wait_for()
    page = logged_in.goto("/policy")
    page.get_by_role("link", name="Suggest rules…").click()
    page.wait_for_url(re.compile(r"/policy/suggest$"))
    page.get_by_label("Workload ids").fill(lab.ids["web-1"])
    page.get_by_label("last 1h").check()
    page.get_by_role("button", name="Suggest rules").click()
    page.locator("[data-proposal]").wait_for()
    assert "evidence gap (buffer_overflow)" in page.locator("[data-incomplete]").inner_text()
    proposed = page.locator("[data-proposed-rule]")
    assert proposed.count() == 1
    assert (
        "group:suggested app=web rule 1 peers" in proposed.inner_text() and "tcp/22" in proposed.inner_text()
    )
    # peers collapsed into a count, expanded on request; the rule kept by a ticked box; the table fits
    assert "192.0.2.9" not in proposed.inner_text()
    proposed.locator("[data-peers] summary").click()
    assert "192.0.2.9" in proposed.inner_text()
    assert proposed.get_by_role("checkbox").is_checked()
    assert re.search(r"\d+ admitted / 1 seen", proposed.locator("[data-breadth]").inner_text())
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    logged_in.shot("suggest-proposal")
    page.get_by_role("button", name="Save the ticked rules").click()
    page.locator("[data-created]").wait_for()
    assert "suggested app=web" in page.locator("[data-created]").inner_text()
    logged_in.shot("suggest-saved")
    page.locator("[data-simulation]").click()
    page.wait_for_url(re.compile(r"/mode-changes\?"))
    assert page.get_by_label("simulation").is_checked()
    assert "1 workload selected" in page.locator("#mode-change").inner_text()
    groups = lab.http.get("/api/v1/address-groups").json()["address_groups"]
    assert {"suggested app=web rule 1 peers": ["192.0.2.9"]}.items() <= {
        g["name"]: g["members"] for g in groups
    }.items()
    # The saved rule's edit form: its impact over past traffic, before saving a change to it.
    page = logged_in.goto("/policy")
    page.get_by_role("link", name="suggested app=web", exact=True).click()
    page.get_by_role("link", name="Edit").first.click()
    page.get_by_label("Services").fill("tcp/23")
    page.get_by_role("button", name="Impact over past traffic").click()
    headline = page.locator("[data-impact-headline]")
    headline.wait_for()
    assert "this change would have refused" in headline.inner_text()
    assert "from 1 peer to 1 service" in headline.inner_text()
    logged_in.shot("rule-impact")
    logged_in.check()


def test_logout_ends_the_session(logged_in, lab):
    page = logged_in.goto("/")
    page.get_by_role("button", name="Log out").click()
    page.wait_for_url(re.compile(r"/login"))
    logged_in.goto("/tokens")
    assert "/login" in page.url
    logged_in.check()


def test_a_confirmation_works_with_scripting_off(browser, lab):
    """The confirmation step is a page and two plain forms' worth of HTML: no script needed."""
    secret = lab.http.post("/api/v1/operator-tokens", json={"name": "no-script"}).json()["token"]
    bearer = {"Authorization": f"Bearer {secret}"}
    context = browser.new_context(ignore_https_errors=True, java_script_enabled=False)
    try:
        page = Watched(context.new_page(), lab.serve.operator_url)
        page.goto("/tokens")
        page.page.get_by_label("Operator password").fill(PASSWORD)
        page.page.get_by_role("button", name="Log in").click()
        page.page.wait_for_url(re.compile(r"/tokens$"))
        row = page.page.locator("tr", has_text="no-script")
        row.get_by_role("link", name="Revoke").click()
        asked(page.page, "Revoke operator token", "no-script")
        page.page.get_by_role("link", name="Cancel").click()
        page.page.wait_for_url(re.compile(r"/tokens$"))
        assert lab.http.get("/api/v1/me", headers=bearer).status_code == 200
        page.page.locator("tr", has_text="no-script").get_by_role("link", name="Revoke").click()
        page.page.get_by_role("button", name="Revoke the token").click()
        page.page.get_by_text("Revoked.").wait_for()
        assert lab.http.get("/api/v1/me", headers=bearer).status_code == 401
        page.check()
    finally:
        context.close()
