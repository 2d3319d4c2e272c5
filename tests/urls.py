from django.contrib import admin
from django.urls import include, path

from tests.async_views import export_report, export_report_unlocked

urlpatterns = [
    path("admin/", admin.site.urls),
    path("joblock/", include("django_joblock.urls")),
    path("async/export/", export_report),
    path("async/export-unlocked/", export_report_unlocked),
]
