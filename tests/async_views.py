"""An async view holding a lock, as the README shows, for the ASGI tests."""

from __future__ import annotations

import asyncio
import time

from django.http import HttpRequest, JsonResponse

from django_joblock import alock


async def export_report(request: HttpRequest) -> JsonResponse:
    async with alock("report:export", ttl=10, wait=30):
        started = time.monotonic()
        await asyncio.sleep(0.2)  # the work the lock protects
        return JsonResponse({"started": started, "ended": time.monotonic()})


async def export_report_unlocked(request: HttpRequest) -> JsonResponse:
    """The same work without the lock (the negative control)."""
    started = time.monotonic()
    await asyncio.sleep(0.2)
    return JsonResponse({"started": started, "ended": time.monotonic()})
