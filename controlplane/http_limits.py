"""serve's HTTP/1.1 channel: requests Twisted refuses before any application code runs still get an
immediate problem document.

Twisted closes the connection without a word when the request line or one header passes 16 KiB
(`LineReceiver.lineLengthExceeded`), and answers all headers over 16 KiB, or a malformed one, with a
bare `400 Bad Request` and no body. Clients then waited for a timeout, or got an error they could not
read. The limits stay Twisted's; only the answers change.

The channel also tells the connection under it (controlplane/connection_limits.py) where the request
is, so that the time to send a request head and the rate of its body can be bounded there, below TLS.

A request body is kept in memory up to `SPOOL_BYTES`, and only then in a temporary file, while fewer than
`MAX_SPILLED_BODIES` are: Twisted gave every body declared at 100 KB or more, and every chunked one, a
file from its first byte, so each slow body cost a second descriptor beside its connection's, which
the connection caps did not count (measured: 1,100 slow bodies took serve past its descriptor limit).

Requests are built without Twisted's parse of a POST's form content: daphne hands the body to the
application as it came, so that parse was never used, and reading the Content-Type header for it
(through the `email` package) cost a tenth of serve's CPU per flow report.
"""

from __future__ import annotations

import functools
import io
import json
import tempfile
import weakref

from twisted.web import http

from controlplane import metrics
from controlplane.api.errors import PROBLEM_CONTENT_TYPE
from controlplane.body_gate import BodyGate
from controlplane.connection_limits import MAX_SPILLED_BODIES, LimitedConnection
from controlplane.listeners import listener_for_port
from controlplane.problems import Problem
from controlplane.response_headers import STRICT_TRANSPORT_SECURITY


def _problem_bytes(problem: Problem, *, instance: str | None = None) -> bytes:
    body = json.dumps(problem.document(instance=instance)).encode()
    reason = http.RESPONSES.get(problem.status, b"Error")
    headers = [STRICT_TRANSPORT_SECURITY, *problem.headers.items()]
    extra = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in headers)
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n" % (
        problem.status,
        reason,
        PROBLEM_CONTENT_TYPE.encode(),
        len(body),
        extra,
    )
    return head + body


SPOOL_BYTES = 1024 * 1024


class BodyFile(tempfile.SpooledTemporaryFile):
    """A request body: in memory, and in a temporary file past SPOOL_BYTES while a file is free."""

    spilled = 0  # bodies in a file now, over all requests

    def rollover(self):
        if self._rolled or BodyFile.spilled >= MAX_SPILLED_BODIES:
            return  # stays in memory: called again at the next write, so it spills once a file is free
        super().rollover()
        BodyFile.spilled += 1
        # Closed by the request when it ends, or collected with an upgraded request that never does.
        self._spill = weakref.finalize(self, BodyFile._unspill)

    @staticmethod
    def _unspill():
        BodyFile.spilled -= 1

    def close(self):
        super().close()
        spill = getattr(self, "_spill", None)
        if spill is not None:
            spill()  # once only: a finalizer runs at most once


def _got_length(request: http.Request, length: int | None) -> None:
    if length is not None and length <= SPOOL_BYTES:
        request.content = io.BytesIO()  # Twisted stops at the declared length
    else:
        request.content = BodyFile(max_size=SPOOL_BYTES)


@functools.cache
def _with_body_file(factory):
    if not isinstance(factory, type):
        return factory  # not a request class: nothing to change
    from daphne.http_protocol import WebRequest

    from controlplane.plain_reports import PlainReportRequest  # Django's side: imported once it is set up

    # daphne's requests also answer plain flow reports without its ASGI application.
    bases = (PlainReportRequest, factory) if issubclass(factory, WebRequest) else (factory,)
    return type(factory.__name__, bases, {"gotLength": _got_length})


class LimitedHTTPChannel(BodyGate, http.HTTPChannel):
    _request_factory = functools.partial(_with_body_file(http.Request), parsePOSTFormSubmission=False)

    @property
    def requestFactory(self):
        return self._request_factory

    @requestFactory.setter
    def requestFactory(self, factory):  # daphne sets its own request class here
        self._request_factory = functools.partial(_with_body_file(factory), parsePOSTFormSubmission=False)

    _limits: LimitedConnection | None = None

    def connectionMade(self):
        super().connectionMade()
        # The TLS protocol is this channel's transport; the limited connection is the TLS protocol's.
        transport = self.transport
        for _ in range(3):
            if isinstance(transport, LimitedConnection):
                self._limits = transport
                break
            transport = getattr(transport, "transport", None)

    def allHeadersReceived(self):
        if self._limits is not None:
            self._limits.head_received()  # first: the body gate may admit the body (and pace it) at once
        super().allHeadersReceived()
        if self._limits is not None and self._gate_checking:  # the gate reads nothing until its check is done
            self._limits.body_held()

    def _gate_checked(self, *args):
        if self._limits is not None:
            self._limits.body_resumed()
        super()._gate_checked(*args)

    def allContentReceived(self):
        if self._limits is not None:
            # daphne upgrades inside the call below, and answers a refused upgrade there too.
            upgrade = self.requests[-1].requestHeaders.getRawHeaders(b"upgrade") or [b""]
            self._limits.content_received(upgrade=upgrade[0].lower() == b"websocket")
        super().allContentReceived()

    def requestDone(self, request):
        # Before Twisted parses a pipelined request it buffered, which starts that request's own phase.
        # Also when the connection is not persistent: Twisted closes it only once the answer is sent,
        # and a client that never reads would otherwise hold it for ever.
        if self._limits is not None:
            self._limits.response_done()
        super().requestDone(request)

    def refuse(self, problem: Problem, *, instance: str | None = None) -> None:
        metrics.answered_unread(listener_for_port(self.transport.getHost().port), problem, path=instance)
        self.transport.write(_problem_bytes(problem, instance=instance))
        self.loseConnection()

    def lineLengthExceeded(self, line):
        self.refuse(
            Problem(
                "header-too-large",
                f"The request line or a header is longer than {self.MAX_LENGTH} bytes.",
                max_bytes=self.MAX_LENGTH,
            )
        )

    def _respondToBadRequestAndDisconnect(self):
        if self._receivedHeaderSize > self.totalHeadersSize:
            problem = Problem(
                "header-too-large",
                f"The request's headers are longer than {self.totalHeadersSize} bytes in all.",
                max_bytes=self.totalHeadersSize,
            )
        else:
            problem = Problem("malformed-request", "The request line or a header is malformed.")
        self.refuse(problem)


def limited_channel_protocol() -> http._GenericHTTPChannelProtocol:
    """For `HTTPFactory.protocol`: Twisted's own wrapper (it switches to HTTP/2 after ALPN) around our channel."""
    return http._GenericHTTPChannelProtocol(LimitedHTTPChannel())
