from django.urls import path

from fleet.api import views

urlpatterns = [
    path("workloads", views.WorkloadListView.as_view()),
    path("workloads/counts", views.WorkloadCountsView.as_view()),
    path("workloads/<str:workload_id>", views.WorkloadView.as_view()),
    path("workloads/<str:workload_id>/rendered-policy", views.RenderedPolicyView.as_view()),
    path("workloads/<str:workload_id>/labels", views.LabelsView.as_view()),
    path("workloads/<str:workload_id>/resend-snapshot", views.ResendSnapshotView.as_view()),
    path("workloads/<str:workload_id>/revoke-credential", views.RevokeCredentialView.as_view()),
    path("mode-changes", views.ModeChangeView.as_view()),
    path("mode-changes/<str:mode_change_id>", views.ModeChangeDetailView.as_view()),
    path("mode-changes/<str:mode_change_id>/confirm", views.ModeChangeConfirmView.as_view()),
    path("selectors/preview", views.SelectorPreviewView.as_view()),
]
