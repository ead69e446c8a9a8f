"""serve's HTTP channel (controlplane/http_limits.py) builds requests without Twisted's form parse:
daphne hands bodies to the application as they came."""

from __future__ import annotations

from controlplane.http_limits import LimitedHTTPChannel


def test_requests_are_built_without_twisteds_parse_of_form_bodies():
    built = []
    channel = LimitedHTTPChannel()
    channel.requestFactory = lambda *args, **kwargs: built.append((args, kwargs))  # as daphne sets its own
    channel.requestFactory(channel, 0)
    assert built == [((channel, 0), {"parsePOSTFormSubmission": False})]
    assert LimitedHTTPChannel().requestFactory.keywords == {"parsePOSTFormSubmission": False}
