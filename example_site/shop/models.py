"""The example shop: orders that get refunds, receipts, and tenants with a cache."""

from __future__ import annotations

from decimal import Decimal

from django.db import models

from django_joblock.models import FencedModel


class Tenant(FencedModel):
    name = models.CharField(max_length=50, unique=True)
    cache_version = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.name


class Order(FencedModel):
    """Refunds are applied with a read-modify-write of ``refunded``: the lock serialises them,
    the fence rejects a stale holder, the idempotency record stops a duplicate."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="orders")
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    refunded = models.DecimalField(max_digits=10, decimal_places=2, default=Decimal("0"))
    refund_count = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"order {self.pk}"


class Refund(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="refunds")
    refund_id = models.CharField(max_length=50, unique=True)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)


class Receipt(models.Model):
    """One receipt e-mail per order: the unique ``order`` is the article's
    ``email_receipts(sent_key)`` constraint, the idempotency record replays the result."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="receipt")
    message_id = models.CharField(max_length=64)
    sent_at = models.DateTimeField(auto_now_add=True)
