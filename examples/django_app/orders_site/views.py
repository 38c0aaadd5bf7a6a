"""``POST /orders`` writes the order and its event in one ``atomic()``; ``GET`` shows it."""

from __future__ import annotations

import json

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

import aiooutbox.sync

from .models import Order


@require_POST
def create_order(request: HttpRequest) -> HttpResponse:
    try:
        body = json.loads(request.body)
        email, item, quantity = str(body["email"]), str(body["item"]), int(body["quantity"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "expected email, item and quantity"}, status=422)
    if not 0 < quantity <= 1000:
        return JsonResponse({"error": "quantity must be 1-1000"}, status=422)
    with transaction.atomic():  # the order and its event commit together, or neither does
        order = Order.objects.create(email=email, item=item, quantity=quantity)
        aiooutbox.sync.enqueue(
            connection,
            "orders.created",
            {"order_id": order.id, "email": email},
            dedupe_key=f"order-{order.id}-created",
        )
    return JsonResponse({"id": order.id}, status=201)


@require_GET
def get_order(request: HttpRequest, order_id: int) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT o.item, o.quantity, e.sent_at FROM orders o"
            " LEFT JOIN emails e ON e.order_id = o.id WHERE o.id = %s",
            [order_id],
        )
        row = cursor.fetchone()
    if row is None:
        return JsonResponse({"error": "no such order"}, status=404)
    item, quantity, sent_at = row
    return JsonResponse(
        {
            "id": order_id,
            "item": item,
            "quantity": quantity,
            "confirmation_email": {
                "status": "sent" if sent_at else "pending",
                "sent_at": sent_at.isoformat() if sent_at else None,
            },
        }
    )
