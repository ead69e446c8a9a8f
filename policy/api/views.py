"""Policy endpoints: each handler parses, calls one domain function and renders."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.responses import expected_version, versioned
from controlplane.api.schema import COMMON_ERRORS, CONDITIONAL_ERRORS, IF_MATCH, WRITE_ERRORS, problem
from controlplane.conditional import version_text
from policy import selectors, services
from policy.api.schemas import (
    AddressGroupListSerializer,
    AddressGroupSerializer,
    RuleSerializer,
    RulesetListSerializer,
    RulesetSerializer,
    ServiceListSerializer,
    ServiceSerializer,
)
from policy.representations import address_group_data, rule_data, ruleset_data, service_data

NOT_FOUND = {404: problem("`not-found`.")}
IN_USE = {409: problem("`in-use`: referenced by rules, named in `referenced_by`.")}


def created(data: dict, version: int, location: str) -> Response:
    response = versioned(data, version, status=201)
    response["Location"] = location
    return response


class RulesetListView(APIView):
    @extend_schema(operation_id="rulesets_list", responses={200: RulesetListSerializer, **COMMON_ERRORS})
    def get(self, request):
        return Response(
            {
                "rulesets": [ruleset_data(r) for r in selectors.ruleset_list()],
                "policy_version": version_text(selectors.policy_version()),
            }
        )

    @extend_schema(
        operation_id="rulesets_create",
        request=RulesetSerializer,
        responses={201: RulesetSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        ruleset = services.ruleset_create(actor=request.user, data=request.data)
        ruleset = selectors.ruleset_get(ruleset_id=ruleset.id)
        return created(ruleset_data(ruleset), ruleset.version, f"/api/v1/rulesets/{ruleset.id}")


class RulesetView(APIView):
    @extend_schema(
        operation_id="rulesets_get", responses={200: RulesetSerializer, **NOT_FOUND, **COMMON_ERRORS}
    )
    def get(self, request, ruleset_id):
        ruleset = selectors.ruleset_get(ruleset_id=ruleset_id)
        return versioned(ruleset_data(ruleset), ruleset.version)

    @extend_schema(
        operation_id="rulesets_replace",
        parameters=[IF_MATCH],
        request=RulesetSerializer,
        responses={200: RulesetSerializer, **CONDITIONAL_ERRORS},
    )
    def put(self, request, ruleset_id):
        services.ruleset_replace(
            actor=request.user,
            ruleset_id=ruleset_id,
            expected_version=expected_version(request),
            data=request.data,
        )
        ruleset = selectors.ruleset_get(ruleset_id=ruleset_id)
        return versioned(ruleset_data(ruleset), ruleset.version)

    @extend_schema(
        operation_id="rulesets_delete", parameters=[IF_MATCH], responses={204: None, **CONDITIONAL_ERRORS}
    )
    def delete(self, request, ruleset_id):
        services.ruleset_delete(
            actor=request.user, ruleset_id=ruleset_id, expected_version=expected_version(request)
        )
        return Response(status=204)


class RuleListView(APIView):
    @extend_schema(
        operation_id="rules_add",
        request=RuleSerializer,
        responses={201: RuleSerializer, **NOT_FOUND, **WRITE_ERRORS},
    )
    def post(self, request, ruleset_id):
        rule = services.rule_add(actor=request.user, ruleset_id=ruleset_id, data=request.data)
        rule = selectors.rule_get(ruleset_id=ruleset_id, rule_id=rule.id)
        return created(rule_data(rule), rule.version, f"/api/v1/rulesets/{ruleset_id}/rules/{rule.id}")


class RuleView(APIView):
    @extend_schema(operation_id="rules_get", responses={200: RuleSerializer, **NOT_FOUND, **COMMON_ERRORS})
    def get(self, request, ruleset_id, rule_id):
        rule = selectors.rule_get(ruleset_id=ruleset_id, rule_id=rule_id)
        return versioned(rule_data(rule), rule.version)

    @extend_schema(
        operation_id="rules_replace",
        parameters=[IF_MATCH],
        request=RuleSerializer,
        responses={200: RuleSerializer, **CONDITIONAL_ERRORS},
    )
    def put(self, request, ruleset_id, rule_id):
        services.rule_replace(
            actor=request.user,
            ruleset_id=ruleset_id,
            rule_id=rule_id,
            expected_version=expected_version(request),
            data=request.data,
        )
        rule = selectors.rule_get(ruleset_id=ruleset_id, rule_id=rule_id)
        return versioned(rule_data(rule), rule.version)

    @extend_schema(
        operation_id="rules_delete", parameters=[IF_MATCH], responses={204: None, **CONDITIONAL_ERRORS}
    )
    def delete(self, request, ruleset_id, rule_id):
        services.rule_delete(
            actor=request.user,
            ruleset_id=ruleset_id,
            rule_id=rule_id,
            expected_version=expected_version(request),
        )
        return Response(status=204)


class ServiceListView(APIView):
    @extend_schema(operation_id="services_list", responses={200: ServiceListSerializer, **COMMON_ERRORS})
    def get(self, request):
        return Response(
            {
                "services": [service_data(s) for s in selectors.service_list()],
                "policy_version": version_text(selectors.policy_version()),
            }
        )

    @extend_schema(
        operation_id="services_create",
        request=ServiceSerializer,
        responses={201: ServiceSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        service = services.service_create(actor=request.user, data=request.data)
        service = selectors.service_get(service_id=service.id)
        return created(service_data(service), service.version, f"/api/v1/services/{service.id}")


class ServiceView(APIView):
    @extend_schema(
        operation_id="services_get", responses={200: ServiceSerializer, **NOT_FOUND, **COMMON_ERRORS}
    )
    def get(self, request, service_id):
        service = selectors.service_get(service_id=service_id)
        return versioned(service_data(service), service.version)

    @extend_schema(
        operation_id="services_replace",
        parameters=[IF_MATCH],
        request=ServiceSerializer,
        responses={200: ServiceSerializer, **CONDITIONAL_ERRORS},
    )
    def put(self, request, service_id):
        services.service_replace(
            actor=request.user,
            service_id=service_id,
            expected_version=expected_version(request),
            data=request.data,
        )
        service = selectors.service_get(service_id=service_id)
        return versioned(service_data(service), service.version)

    @extend_schema(
        operation_id="services_delete",
        parameters=[IF_MATCH],
        responses={204: None, **IN_USE, **CONDITIONAL_ERRORS},
    )
    def delete(self, request, service_id):
        services.service_delete(
            actor=request.user, service_id=service_id, expected_version=expected_version(request)
        )
        return Response(status=204)


class AddressGroupListView(APIView):
    @extend_schema(
        operation_id="address_groups_list", responses={200: AddressGroupListSerializer, **COMMON_ERRORS}
    )
    def get(self, request):
        return Response(
            {
                "address_groups": [address_group_data(g) for g in selectors.address_group_list()],
                "policy_version": version_text(selectors.policy_version()),
            }
        )

    @extend_schema(
        operation_id="address_groups_create",
        request=AddressGroupSerializer,
        responses={201: AddressGroupSerializer, **WRITE_ERRORS},
    )
    def post(self, request):
        group = services.address_group_create(actor=request.user, data=request.data)
        return created(address_group_data(group), group.version, f"/api/v1/address-groups/{group.id}")


class AddressGroupView(APIView):
    @extend_schema(
        operation_id="address_groups_get",
        responses={200: AddressGroupSerializer, **NOT_FOUND, **COMMON_ERRORS},
    )
    def get(self, request, group_id):
        group = selectors.address_group_get(group_id=group_id)
        return versioned(address_group_data(group), group.version)

    @extend_schema(
        operation_id="address_groups_replace",
        parameters=[IF_MATCH],
        request=AddressGroupSerializer,
        responses={200: AddressGroupSerializer, **CONDITIONAL_ERRORS},
    )
    def put(self, request, group_id):
        group = services.address_group_replace(
            actor=request.user,
            group_id=group_id,
            expected_version=expected_version(request),
            data=request.data,
        )
        return versioned(address_group_data(group), group.version)

    @extend_schema(
        operation_id="address_groups_delete",
        parameters=[IF_MATCH],
        responses={204: None, **IN_USE, **CONDITIONAL_ERRORS},
    )
    def delete(self, request, group_id):
        services.address_group_delete(
            actor=request.user, group_id=group_id, expected_version=expected_version(request)
        )
        return Response(status=204)
