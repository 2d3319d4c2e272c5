"""The Prometheus metrics view: an active staff user's login, or
``Authorization: Bearer <METRICS_TOKEN>``."""

from __future__ import annotations

import hmac

from django.http import HttpRequest, HttpResponse

from . import conf
from .backend import REDIS_ERRORS, no_answer


def _authorized(request: HttpRequest) -> bool:
    """An active staff user (as the admin requires: a backend may log inactive users in), or
    the bearer token."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return True
    token = conf.get().METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if token and scheme.lower() == "bearer":  # schemes are case-insensitive (RFC 9110)
        return hmac.compare_digest(given.strip().encode(), token.encode())
    return False


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of django-joblock's metrics."""
    if not _authorized(request):
        response = HttpResponse("Authentication required.", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="django-joblock metrics"'
        return response
    try:
        from prometheus_client import CONTENT_TYPE_LATEST

        from .monitor.prometheus import exposition
    except ImportError:
        message = "Install django-joblock[prometheus] for this view."
        return HttpResponse(message, status=501, content_type="text/plain")
    try:
        text = exposition()
    except REDIS_ERRORS as exc:  # the scraper shows the target down, with why
        return HttpResponse(no_answer(exc), status=503, content_type="text/plain")
    return HttpResponse(text, content_type=CONTENT_TYPE_LATEST)
