"""The console's only way to data: an in-process client that dispatches to the operator API's own
views with the operator's own credential (the session cookie of the browser's request).

Nothing here knows a model: a page asks for `/api/v1/...` like any script would, and gets back the
JSON the API would have sent, status and problem included. What the API refuses, the console refuses.

Inside serve, a heavy call (a rollup, a review, a suggestion, an impact, a dry-run, a selector preview:
controlplane/heavy_pool.py) goes to serve's heavy workers like any client's, queue, deadline and answer
bound included, so that a page never does that work in serve's own interpreter.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.core.handlers.wsgi import WSGIRequest
from django.urls import Resolver404, resolve

from controlplane import heavy_pool
from controlplane.problems import Problem

API_PREFIX = "/api/v1"
PAGE_LIMIT = 500  # the API's largest page


class SessionEnded(Exception):
    """The API answered 401: the browser's session is gone; the page sends the operator to log in."""


@dataclass
class ApiResult:
    status: int
    data: Any
    headers: dict[str, str] = field(default_factory=dict)
    cookies: Any = None  # the API response's cookies (login and logout set them)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def problem(self) -> dict | None:
        """The problem document of a refusal, with `name` (the part after the URN prefix) added."""
        if self.ok:
            return None
        document = dict(self.data) if isinstance(self.data, dict) else {"detail": str(self.data)}
        document["name"] = str(document.get("type", "")).rsplit(":", 1)[-1]
        document.setdefault("status", self.status)
        return document

    def findings_by_field(self) -> dict[str, list[str]]:
        """Validation findings keyed by the first step of their path (`/sources/0/selector` -> `sources`),
        so that a form shows each next to its field; findings with no path go under ``."""
        problem = self.problem or {}
        out: dict[str, list[str]] = {}
        for finding in problem.get("errors") or []:
            path = str(finding.get("path", ""))
            step = path.lstrip("/?").split("/", 1)[0].split("[", 1)[0]
            out.setdefault(step, []).append(str(finding.get("message", "")))
        return out


class ApiClient:
    """`client.get("/workloads", params={"label": [...]})`: paths are relative to /api/v1."""

    def __init__(self, request):
        self._request = request

    def get(self, path: str, *, params: dict | list | None = None) -> ApiResult:
        return self.call("GET", path, params=params)

    def get_all(self, path: str, *, params: dict | None = None, cap: int | None = None) -> ApiResult:
        """Every page of a list read, as one result: `items` holds them all and `next_cursor` is None.
        With `cap`, reading stops once that many are in hand, and `next_cursor` is where the rest begins
        (a page says so, plainly). The other fields (a rollup's coverage) are the first page's."""
        first: ApiResult | None = None
        items: list = []
        cursor = None
        while True:
            page = self.get(
                path, params={**(params or {}), "limit": PAGE_LIMIT, **({"cursor": cursor} if cursor else {})}
            )
            if not page.ok:
                return page
            first = first or page
            items.extend(page.data["items"])
            cursor = page.data["next_cursor"]
            if not cursor or (cap is not None and len(items) >= cap):
                return ApiResult(
                    first.status, {**first.data, "items": items, "next_cursor": cursor}, first.headers
                )

    def post(self, path: str, body: Any = None) -> ApiResult:
        return self.call("POST", path, body=body)

    def put(self, path: str, body: Any, *, if_match: str | None) -> ApiResult:
        return self.call("PUT", path, body=body, if_match=if_match)

    def delete(self, path: str, *, if_match: str | None = None) -> ApiResult:
        return self.call("DELETE", path, if_match=if_match)

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict | list | None = None,
        body: Any = None,
        if_match: str | None = None,
        session_required: bool = True,
    ) -> ApiResult:
        full_path = API_PREFIX + path
        try:
            match = resolve(full_path, urlconf=settings.ROOT_URLCONF)
        except Resolver404:
            return ApiResult(404, {"type": "urn:service:problem:not-found", "detail": f"No {full_path}."})
        environ, payload = self._api_environ(method, full_path, params, body, if_match)
        pool = heavy_pool.current()
        if pool is not None and heavy_pool.is_heavy(full_path, environ["QUERY_STRING"]):
            status, header_list, content = pool.answer(environ, payload)
            headers = dict(header_list)
            cookies = SimpleCookie()
            for name, value in header_list:
                if name.lower() == "set-cookie":
                    cookies.load(value)
        else:
            response = match.func(WSGIRequest(environ), *match.args, **match.kwargs)
            if hasattr(response, "render"):
                response.render()
            status, content, cookies = response.status_code, response.content, response.cookies
            headers = {name: value for name, value in response.items()}
        data = json.loads(content) if content else None
        if status == 401 and session_required:
            raise SessionEnded(data.get("detail", "") if isinstance(data, dict) else "")
        if status == 503:
            # Not a refusal a page can show beside its form: the whole page is "unavailable"
            # (controlplane.api.errors.handler500 renders it).
            raise Problem(
                "service-unavailable",
                data.get("detail", "") if isinstance(data, dict) else "",
                headers={"Retry-After": headers.get("Retry-After", "5")},
                retry_after=data.get("retry_after") if isinstance(data, dict) else None,
            )
        return ApiResult(status, data, headers, cookies)

    def _api_environ(self, method, path, params, body, if_match) -> tuple[dict, bytes]:
        source = self._request.META
        payload = b"" if body is None else json.dumps(body).encode()
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "SCRIPT_NAME": "",
            "QUERY_STRING": urlencode(params or {}, doseq=True),
            "CONTENT_TYPE": "application/json" if body is not None else "",
            "CONTENT_LENGTH": str(len(payload)),
            "wsgi.input": io.BytesIO(payload),
            "wsgi.url_scheme": "https",
            "SERVER_NAME": source.get("SERVER_NAME", "localhost"),
            "SERVER_PORT": source.get("SERVER_PORT", "443"),
            "REMOTE_ADDR": source.get("REMOTE_ADDR", ""),
            "HTTP_HOST": source.get("HTTP_HOST", "localhost"),
            "HTTP_COOKIE": source.get("HTTP_COOKIE", ""),
            "HTTP_ACCEPT": "application/json",
            "HTTP_USER_AGENT": "palisade-console",
        }
        for key in ("palisade.listener",):
            if key in source:
                environ[key] = source[key]
        if if_match is not None:
            environ["HTTP_IF_MATCH"] = f'"{if_match}"'
        return environ, payload


def api(request) -> ApiClient:
    return ApiClient(request)
