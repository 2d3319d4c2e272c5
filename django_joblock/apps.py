"""Django app configuration: registers the system checks."""

from __future__ import annotations

from django.apps import AppConfig


class JoblockConfig(AppConfig):
    name = "django_joblock"
    # The app section; its entries are "Job locks" (the dashboard), the records and the log.
    verbose_name = "django-joblock"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
