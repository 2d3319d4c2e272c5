"""Django app configuration: registers the system checks, and claims ``KEY_PREFIX`` on the
locks' Redis after ``migrate`` (:func:`~django_joblock.monitor.cleanup.claim_key_prefix`)."""

from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class JoblockConfig(AppConfig):
    name = "django_joblock"
    # The app section; its entries are "Job locks" (the dashboard), the records and the log.
    verbose_name = "django-joblock"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .monitor.cleanup import claim_key_prefix

        post_migrate.connect(claim_key_prefix, sender=self)
