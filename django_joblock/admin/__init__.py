"""Django admin for django-joblock, registered when Django's admin autodiscovers this package:
the "Job locks" dashboard, the idempotency records and the lock audit log (:mod:`.records`),
and the outbox (:mod:`.outbox`); what they share is in :mod:`.base`."""

from . import outbox, records

__all__ = ["outbox", "records"]
