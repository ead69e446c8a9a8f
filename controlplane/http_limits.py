"""serve's HTTP/1.1 channel: requests Twisted refuses before any application code runs still get an
immediate problem document.

Twisted closes the connection without a word when the request line or one header passes 16 KiB
(`LineReceiver.lineLengthExceeded`), and answers all headers over 16 KiB, or a malformed one, with a
bare `400 Bad Request` and no body. Clients then waited for a timeout, or got an error they could not
read. The limits stay Twisted's; only the answers change.

Requests are built without Twisted's parse of a POST's form content: daphne hands the body to the
application as it came, so that parse was never used, and reading the Content-Type header for it
(through the `email` package) cost a tenth of serve's CPU per flow report.
"""

from __future__ import annotations

import functools
import json

from twisted.web import http

from controlplane.api.errors import PROBLEM_CONTENT_TYPE
from controlplane.body_gate import BodyGate
from controlplane.problems import Problem


def _problem_bytes(problem: Problem, *, instance: str | None = None) -> bytes:
    body = json.dumps(problem.document(instance=instance)).encode()
    reason = http.RESPONSES.get(problem.status, b"Error")
    extra = b"".join(
        b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in problem.headers.items()
    )
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n" % (
        problem.status,
        reason,
        PROBLEM_CONTENT_TYPE.encode(),
        len(body),
        extra,
    )
    return head + body


class LimitedHTTPChannel(BodyGate, http.HTTPChannel):
    _request_factory = functools.partial(http.Request, parsePOSTFormSubmission=False)

    @property
    def requestFactory(self):
        return self._request_factory

    @requestFactory.setter
    def requestFactory(self, factory):  # daphne sets its own request class here
        self._request_factory = functools.partial(factory, parsePOSTFormSubmission=False)

    def refuse(self, problem: Problem, *, instance: str | None = None) -> None:
        self.transport.write(_problem_bytes(problem, instance=instance))
        self.loseConnection()

    def lineLengthExceeded(self, line):
        self.transport.write(
            _problem_bytes(
                Problem(
                    "header-too-large",
                    f"The request line or a header is longer than {self.MAX_LENGTH} bytes.",
                    max_bytes=self.MAX_LENGTH,
                )
            )
        )
        self.loseConnection()

    def _respondToBadRequestAndDisconnect(self):
        if self._receivedHeaderSize > self.totalHeadersSize:
            problem = Problem(
                "header-too-large",
                f"The request's headers are longer than {self.totalHeadersSize} bytes in all.",
                max_bytes=self.totalHeadersSize,
            )
        else:
            problem = Problem("malformed-request", "The request line or a header is malformed.")
        self.transport.write(_problem_bytes(problem))
        self.loseConnection()


def limited_channel_protocol() -> http._GenericHTTPChannelProtocol:
    """For `HTTPFactory.protocol`: Twisted's own wrapper (it switches to HTTP/2 after ALPN) around our channel."""
    return http._GenericHTTPChannelProtocol(LimitedHTTPChannel())
