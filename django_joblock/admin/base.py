"""What the admin pages of django-joblock share: read-only model admins whose URL lookups
cannot probe hidden columns, a paginator that does not count a huge table, and plain-text 400s
(a reflected parameter never becomes markup)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connections
from django.db.models import QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest, HttpResponse
from django.utils.functional import cached_property
from django.utils.html import format_html

#: The lookups a changelist URL may use on a displayed field (``?attempts__gte=2``).
URL_LOOKUPS = frozenset(
    {
        "exact",
        "iexact",
        "contains",
        "icontains",
        "startswith",
        "istartswith",
        "endswith",
        "iendswith",
        "gt",
        "gte",
        "lt",
        "lte",
        "in",
        "isnull",
    }
)


def bad_request(message: str) -> HttpResponse:
    """A 400 in plain text: a reflected parameter can never become markup."""
    response = HttpResponse(message, status=400, content_type="text/plain; charset=utf-8")
    response["X-Content-Type-Options"] = "nosniff"
    return response


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Nothing is added, edited or deleted through the admin. URL lookups (``?field__lookup=``)
    work on displayed model fields only (a hidden column cannot be probed character by
    character), with the plain comparisons of :data:`URL_LOOKUPS` only (no regular expressions,
    JSON paths or transforms); a value the database refuses is a plain-text 400."""

    def lookup_allowed(self, lookup: str, value: str, request: Any = None) -> bool:
        name, _, rest = lookup.partition(LOOKUP_SEP)
        shown = {*self.list_display, *(self.fields or ()), *self.readonly_fields}
        shown &= {f.name for f in self.model._meta.get_fields()}
        if name not in shown or (rest and rest not in URL_LOOKUPS):
            return False
        field = self.model._meta.get_field(name)
        if rest and (field.is_relation or field.get_internal_type() == "JSONField"):
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Every field shown is read-only: ``readonly_fields``, else ``fields``."""
        return self.readonly_fields or self.fields or ()

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()  # the page's own queries run here: inside the try too
        except (DatabaseError, OverflowError) as exc:
            return bad_request(f"This list cannot be filtered that way: {exc}")
        return response

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Unfiltered lists of a big PostgreSQL table use the planner's row estimate instead of
    ``COUNT(*)`` (a full scan at millions of rows); filtered lists count exactly."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and not queryset.query.where:
            connection = connections[queryset.db]
            if connection.vendor == "postgresql":
                estimate = "SELECT reltuples::bigint FROM pg_class WHERE relname = %s"
                with connection.cursor() as cursor:
                    cursor.execute(estimate, [queryset.model._meta.db_table])
                    row = cursor.fetchone()
                if row is not None and row[0] > 100_000:
                    return int(row[0])
        return int(super().count)


def pretty_json(value: Any) -> str:
    """``value`` as indented JSON in a ``<pre>``, escaped (a stored result, a payload)."""
    text = json.dumps(value, indent=2, sort_keys=True, cls=DjangoJSONEncoder)
    return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', text)


def known_values_filter(field: str, values: Callable[[], Iterable[str]]) -> type:
    """A changelist filter on ``field`` offering ``values()`` (known from code, or read through
    an index), where Django's ``list_filter = (field,)`` runs ``SELECT DISTINCT`` over the
    whole table on every page (221-292 ms at a million records)."""

    class KnownValues(admin.SimpleListFilter):
        title = field
        parameter_name = field

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return [(value, value) for value in sorted(set(values())) if value]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            value = self.value()
            return queryset if value is None else queryset.filter(**{field: value})

    return KnownValues
