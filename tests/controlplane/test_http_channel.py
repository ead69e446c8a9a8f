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


def _request(uri=b"/agent/v1/flows", method=b"POST", headers=(), body=b'{"v": 1}', proxy=None):
    """A request as Twisted hands it to daphne: the gateway's port, a client on an IPv4-mapped address."""
    import io
    from types import SimpleNamespace

    from twisted.internet.address import IPv6Address
    from twisted.web import http
    from twisted.web.test.requesthelper import DummyChannel

    from controlplane import runtime

    channel = DummyChannel()
    channel.transport.port = 14443
    runtime.facts.listener_ports[14443] = "gateway"
    request = http.Request(channel)
    request.client = IPv6Address("TCP", "::ffff:10.1.2.3", 5000)
    request.method, request.uri = method, uri
    request.path = uri.split(b"?")[0]
    for name, value in headers:
        request.requestHeaders.addRawHeader(name, value)
    request.content = io.BytesIO(body)
    request.server = SimpleNamespace(proxy_forwarded_address_header=proxy)
    return request


def test_a_plain_flow_report_gets_the_environ_daphne_and_asgiref_would_give_it():
    """serve hands a plain flow report to its threads without daphne's application
    (controlplane/plain_reports.py): the environ its answer reads is the one the application built."""
    import io

    from asgiref.wsgi import WsgiToAsgiInstance

    from controlplane.plain_reports import _plain_report_environ

    headers = [
        (b"Content-Type", b"application/json"),
        (b"Palisade-Workload", b"W"),
        (b"Palisade-Credential", b"C"),
        (b"Palisade-Signature", b"S"),
        (b"X-Twice", b"one"),
        (b"X-Twice", b"two"),
        (b"Palisade_Workload", b"smuggled"),  # daphne leaves names with _ out (CVE-2015-0219)
    ]
    ours = _plain_report_environ(_request(headers=headers))
    # What daphne puts in the scope, and what http_threads.py makes of it.
    scope = {
        "type": "http", "method": "POST", "path": "/agent/v1/flows", "raw_path": b"/agent/v1/flows",
        "root_path": "", "scheme": "https", "query_string": b"", "http_version": "1.1",
        "headers": [(n.lower(), v) for n, v in headers if b"_" not in n],
        "client": ["::ffff:10.1.2.3", 5000], "server": ["10.0.0.1", 14443],
    }  # fmt: skip
    builder = WsgiToAsgiInstance(None)
    builder.scope = scope
    theirs = builder.build_environ(scope, io.BytesIO(b""))
    for key in [k for k in theirs if k.startswith("HTTP_")] + [
        "CONTENT_TYPE",
        "REQUEST_METHOD",
        "QUERY_STRING",
    ]:
        assert ours[key] == theirs[key], key
    assert {k for k in ours if k.startswith("HTTP_")} == {k for k in theirs if k.startswith("HTTP_")}
    assert ours["HTTP_X_TWICE"] == "one,two" and ours["HTTP_PALISADE_WORKLOAD"] == "W"
    assert ours["CONTENT_LENGTH"] == "8" and ours["wsgi.input"].read() == b'{"v": 1}'
    assert ours["REMOTE_ADDR"] == "10.1.2.3" and ours["palisade.listener"] == "gateway"


def test_any_other_request_goes_through_daphnes_application():
    from django.conf import settings

    from controlplane.plain_reports import _plain_report_environ

    assert _plain_report_environ(_request()) is not None
    for other in (
        _request(uri=b"/agent/v1/flows?x=1"),
        _request(uri=b"/agent/v1/%66lows"),
        _request(method=b"PUT"),
        _request(headers=[(b"Origin", b"https://elsewhere")]),
        _request(headers=[(b"Sec-Fetch-Site", b"same-origin")]),
        _request(headers=[(b"Upgrade", b"websocket")]),
        _request(headers=[(b"X-Bad", b"a\x0bb")]),  # daphne answers 400
        _request(proxy="X-Forwarded-For"),
        _request(body=b"x" * (settings.PALISADE_MAX_FLOW_REPORT_BYTES + 1)),  # Django's 413
    ):
        assert _plain_report_environ(other) is None
