"""The agent gateway listener: agent paths only (enrolment, flow reports, the sync stream)."""

from channels.routing import URLRouter
from django.urls import path, re_path

from agent.protocol import ENROL_PATH, FLOWS_PATH, STREAM_PATH
from controlplane.api.errors import handler404, handler500  # noqa: F401  (Django looks them up here)
from controlplane.gateway_views import gateway_info
from fleet.gateway import EnrolView, SyncStreamConsumer
from flows.gateway import FlowReportView


async def refuse_websocket(scope, receive, send):
    await receive()  # websocket.connect
    await send({"type": "websocket.close", "code": 4404})


urlpatterns = [
    path("agent/v1/info", gateway_info, name="gateway-info"),
    path(ENROL_PATH.lstrip("/"), EnrolView.as_view(), name="gateway-enrol"),
    path(FLOWS_PATH.lstrip("/"), FlowReportView.as_view(), name="gateway-flows"),
]

websocket_urlpatterns: list = [
    path(STREAM_PATH.lstrip("/"), SyncStreamConsumer.as_asgi()),
    re_path(r"", refuse_websocket),
]

websocket_application = URLRouter(websocket_urlpatterns)
