"""Settings of the example site: SQLite by default, Redis from REDIS_URL."""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-site-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "django_joblock",
    "example_site.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_site.urls"
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
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "example.sqlite3")),
        # Several worker processes write at once: queue for the lock instead of failing.
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
    }
}
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    }
}
# django-rq's queues on that Redis: the demo's jobs and tasks run on DEMO_QUEUE.
DEMO_QUEUE = os.environ.get("JOBLOCK_DEMO_QUEUE", "demo")
RQ_QUEUES = {name: {"USE_REDIS_CACHE": "default"} for name in ("default", DEMO_QUEUE)}
# Django tasks (shop/tasks.py) on RQ, with @locked_task's admission (docs/tasks.md).
TASKS = {"default": {"BACKEND": "django_joblock.jobs.rq_tasks.RQBackend", "QUEUES": [DEMO_QUEUE]}}
# Every key is optional; these are the defaults spelled out.
JOBLOCK = {
    "REDIS_ALIAS": "default",
    "LOCK_TTL": 30,
    "ACQUIRE_WAIT": 0,
    # Fast backoff for the demo's short jobs (production default: base 1, max 300).
    "REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4},
}
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_joblock": {"handlers": ["console"], "level": "WARNING"}},
}
