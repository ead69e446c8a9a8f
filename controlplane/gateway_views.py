from django.http import JsonResponse

from controlplane import __version__

AGENT_PROTOCOL_VERSION = 1


def gateway_info(request):
    """Lets an agent check it reached a Palisade gateway that speaks its protocol, before enrolling."""
    return JsonResponse(
        {"service": "palisade-gateway", "version": __version__, "protocol": AGENT_PROTOCOL_VERSION}
    )
