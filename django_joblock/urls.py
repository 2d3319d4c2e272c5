"""``path("joblock/", include("django_joblock.urls"))`` exposes ``metrics/`` for Prometheus."""

from django.urls import path

from .views import metrics_view

app_name = "django_joblock"
urlpatterns = [path("metrics/", metrics_view, name="metrics")]
