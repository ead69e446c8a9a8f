from django.http import JsonResponse

from agent.protocol import PROTOCOL_VERSION
from controlplane import __version__


def gateway_info(request):
    """Lets an agent check it reached a Palisade gateway that speaks its protocol, before enrolling."""
    return JsonResponse({"service": "palisade-gateway", "version": __version__, "protocol": PROTOCOL_VERSION})
