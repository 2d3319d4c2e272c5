"""Two admin sites, as a project with an operators' site beside its main one: the dashboard is
registered on both (``/admin/`` and ``/ops/``)."""

from django.contrib import admin
from django.urls import path

from django_joblock.admin.records import DashboardAdmin
from django_joblock.models import Dashboard

ops = admin.AdminSite(name="ops")
ops.register(Dashboard, DashboardAdmin)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("ops/", ops.urls),
]
