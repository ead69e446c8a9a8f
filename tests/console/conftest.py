"""What a failed browser test leaves behind: the page it was on (address, title, the start of its text)
in the failure's report, and its screenshot and HTML beside the others (tests/console/screenshots/,
a CI artifact). A locator that times out says only what it waited for; this says what was there."""

from __future__ import annotations

from pathlib import Path

import pytest

SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
TEXT_SHOWN = 1500


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    watched = getattr(item, "funcargs", {}).get("logged_in")
    if report.when != "call" or not report.failed or watched is None:
        return
    page = watched.page
    try:
        name = f"failed-{item.name}"
        watched.shot(name)
        (SCREENSHOTS / f"{name}.html").write_text(page.content())
        seen = f"{page.url}\ntitle: {page.title()}\n\n{page.inner_text('body')[:TEXT_SHOWN]}"
    except Exception as error:  # noqa: BLE001 - the page may be gone; the failure itself stands
        seen = f"(the page could not be read: {type(error).__name__}: {error})"
    report.sections.append(("the page at the failure", seen))
