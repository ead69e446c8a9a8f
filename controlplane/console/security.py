"""Headers every console page carries: a Content-Security-Policy that admits only this origin's own
scripts and styles (no inline script, no eval, no other origin), no framing, no sniffing."""

from __future__ import annotations

from django.conf import settings

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "font-src 'self'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class ConsoleSecurityHeadersMiddleware:
    """The API's own documentation pages (Swagger UI, ReDoc under /api/v1/) bring their own inline
    bootstrap script, so the strict policy covers the console and its static files, not /api/."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        response.setdefault("X-Frame-Options", "DENY")
        response.setdefault("X-Content-Type-Options", "nosniff")
        if not request.path.startswith("/api/"):
            response.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
            response.setdefault("Referrer-Policy", "same-origin")
            if not request.path.startswith(settings.STATIC_URL):
                response.setdefault("Cache-Control", "no-store")
        return response
