from django.contrib import admin

from .models import Order, Receipt, Refund, Tenant

admin.site.register(Tenant)
admin.site.register(
    Order, list_display=("id", "tenant", "amount", "refunded", "refund_count", "lock_fence")
)
admin.site.register(Refund, list_display=("refund_id", "order", "amount", "created_at"))
admin.site.register(Receipt, list_display=("order", "message_id", "sent_at"))
