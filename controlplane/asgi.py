"""ASGI entry: stamps each connection with the listener it arrived on, then hands HTTP to Django (heavy
requests to serve's worker processes) and websockets to the gateway's consumers. Websockets exist only on
the gateway listener."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

from controlplane import heavy_pool  # noqa: E402
from controlplane.http_threads import ThreadPoolHttp  # noqa: E402

# Heavy requests run in worker processes started here, with the application (controlplane/heavy_pool.py);
# the console's in-process API client finds them through `heavy_pool.current()`.
heavy = heavy_pool.HeavyPool().start()
heavy_pool.install(heavy)
django_http = ThreadPoolHttp(heavy=heavy)

from controlplane.listeners import GATEWAY, listener_for_scope  # noqa: E402
from controlplane.urls_gateway import refuse_websocket, websocket_application  # noqa: E402


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        return
    listener = listener_for_scope(scope)
    scope = dict(scope, palisade_listener=listener)
    if scope["type"] == "http":
        return await django_http(scope, receive, send)
    if scope["type"] == "websocket" and listener == GATEWAY:
        return await websocket_application(scope, receive, send)
    return await refuse_websocket(scope, receive, send)
