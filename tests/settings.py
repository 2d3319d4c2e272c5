"""Settings for the test suite: PostgreSQL from DATABASE_URL, else SQLite; a throwaway Redis."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dj_database_url

from tests import harness

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "django_tasks_db",
    "django_joblock",
    "tests.testapp",
]
# django-rq's queues ride on the django-redis cache: @locked_job("default") resolves here.
RQ_QUEUES = {"default": {"USE_REDIS_CACHE": "default"}, "other": {"USE_REDIS_CACHE": "default"}}

# A run's own test database (runs side by side must not share one); its worker processes
# inherit the name through the environment.
RUN = os.environ.setdefault("JOBLOCK_TEST_RUN", str(os.getpid()))
_sqlite = f"sqlite:///{BASE_DIR.parent / '.test-db.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(os.environ.get("DATABASE_URL") or _sqlite)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file (not :memory:) so that subprocesses started by a test see the same test database;
    # IMMEDIATE transactions and a busy timeout so that concurrent writers queue, not fail.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR.parent / f".test-db-{RUN}.sqlite3")}
    DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 30}
else:
    DATABASES["default"]["TEST"] = {"NAME": f"test_joblock_{RUN}"}
if os.environ.get("JOBLOCK_CHILD_DB_NAME"):
    # A child process started by a test: use the test database the parent created.
    DATABASES["default"]["NAME"] = os.environ["JOBLOCK_CHILD_DB_NAME"]

REDIS_URL = harness.redis_url()

# Django tasks (tests/task_jobs.py): inline, on RQ through django-joblock, in the database.
try:
    import django.tasks  # noqa: F401  (Django >= 6.0)

    _IMMEDIATE = "django.tasks.backends.immediate.ImmediateBackend"
except ImportError:  # Django 5.2: the django-tasks backport
    _IMMEDIATE = "django_tasks.backends.immediate.ImmediateBackend"
TASKS = {
    "default": {"BACKEND": _IMMEDIATE},
    "rq": {"BACKEND": "django_joblock.jobs.rq_tasks.RQBackend", "QUEUES": ["default"]},
    "db": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": []},  # any queue name
}


def _cache(location: str) -> dict[str, object]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    }


CACHES = {
    "default": _cache(REDIS_URL),
    # Same server behind the test TCP proxy (delay / black-hole faults).
    "proxied": _cache(harness.proxy_url()),
    # Nothing listens here: a Redis that is down.
    "down": _cache(harness.dead_url()),
    "locmem": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}

# Worker processes started by a test get that test's JOBLOCK through the environment.
JOBLOCK: dict[str, object] = json.loads(os.environ.get("JOBLOCK_TEST_SETTINGS") or "{}")

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_joblock": {"level": "DEBUG"}},
}
