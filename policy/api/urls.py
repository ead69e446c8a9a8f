from django.urls import path

from policy.api import views

urlpatterns = [
    path("rulesets", views.RulesetListView.as_view()),
    path("rulesets/<str:ruleset_id>", views.RulesetView.as_view()),
    path("rulesets/<str:ruleset_id>/rules", views.RuleListView.as_view()),
    path("rulesets/<str:ruleset_id>/rules/<str:rule_id>", views.RuleView.as_view()),
    path("services", views.ServiceListView.as_view()),
    path("services/<str:service_id>", views.ServiceView.as_view()),
    path("address-groups", views.AddressGroupListView.as_view()),
    path("address-groups/<str:group_id>", views.AddressGroupView.as_view()),
]
