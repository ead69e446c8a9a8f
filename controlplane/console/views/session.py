"""Log in and log out: the API's POST and DELETE /session; the cookie the API sets travels on."""

from __future__ import annotations

from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.console.client import ApiClient
from controlplane.console.pages import go, operator_page, page


def _safe_next(target: str | None) -> str:
    # Only a path of this site: never an open redirect to another origin.
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


def _with_cookies(response, result):
    for morsel in (result.cookies or {}).values():
        response.cookies[morsel.key] = morsel
    return response


@require_http_methods(["GET", "POST"])
def login(request):
    next_path = _safe_next(request.POST.get("next") or request.GET.get("next"))
    context = {"next": next_path, "ended": request.GET.get("ended") == "1", "problem": None}
    if request.method == "POST":
        result = ApiClient(request).call(
            "POST", "/session", body={"password": request.POST.get("password", "")}, session_required=False
        )
        if result.ok:
            return _with_cookies(go(request, next_path), result)
        context["problem"] = result.problem
        return page(request, "console/login.html", context, status=result.status)
    return render(request, "console/login.html", context)


@require_POST
@operator_page
def logout(request, api):
    result = api.delete("/session")
    return _with_cookies(redirect("/login"), result)
