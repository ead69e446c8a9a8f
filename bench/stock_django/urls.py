from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView


class MeView(APIView):
    """The same answer as Palisade's GET /api/v1/me, from DRF's stock token authentication."""

    def get(self, request):
        return Response(
            {
                "operator": "operator",
                "credential": {"kind": "token", "label": f"token {request.user.username}"},
                "site_label": "",
                "gateway_address": "localhost:8443",
                "version": "0.1.0",
            }
        )


urlpatterns = [path("api/v1/me", MeView.as_view())]
