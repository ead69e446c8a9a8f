"""`GET /metrics` on the operator listener: the Prometheus exposition of this process's instruments
(controlplane/metrics.py) and of the fleet's figures, read from the database as it is scraped
(controlplane/metrics_collector.py, registered when Django starts: controlplane/apps.py). docs/metrics.md
lists every metric.

It needs a credential as every operator endpoint does (an operator token as a bearer credential is what
Prometheus's `authorization` setting sends; a session cookie works too), and answers 401 with the
`unauthenticated` problem without one. It lives beside the API rather than under /api/v1 (Prometheus's
default `metrics_path`) and is not a JSON resource, so the OpenAPI document leaves it out.
"""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client.exposition import choose_encoder
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.views import APIView

from controlplane import metrics


class WhateverIsAccepted(BaseContentNegotiation):
    """The answer's format follows Prometheus's Accept header (`choose_encoder`: OpenMetrics when
    asked for, the text format otherwise); DRF's JSON-only negotiation would refuse it with a 406."""

    def select_parser(self, request, parsers):
        return None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class MetricsView(APIView):
    content_negotiation_class = WhateverIsAccepted

    @extend_schema(exclude=True)
    def get(self, request):
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return HttpResponse(encode(metrics.REGISTRY), content_type=content_type)
