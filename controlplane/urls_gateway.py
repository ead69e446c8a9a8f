"""The agent gateway listener: agent paths only (enrolment, the sync stream)."""

from channels.routing import URLRouter
from django.urls import path, re_path

from controlplane.api.errors import handler404, handler500  # noqa: F401  (Django looks them up here)
from controlplane.gateway_views import gateway_info


async def refuse_websocket(scope, receive, send):
    await receive()  # websocket.connect
    await send({"type": "websocket.close", "code": 4404})


urlpatterns = [
    path("agent/v1/info", gateway_info, name="gateway-info"),
]

websocket_urlpatterns: list = [
    re_path(r"", refuse_websocket),
]

websocket_application = URLRouter(websocket_urlpatterns)
