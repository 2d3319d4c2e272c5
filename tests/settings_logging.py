"""Test settings for a worker started by a test, with the LOGGING of docs/observability.md (so
the worker's log shows the library's INFO lines: one per job outcome)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

# Verbatim from docs/observability.md ("Reading the worker log"); a test compares the two.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_joblock": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}
