"""The ``orders`` table of examples/orders.py, as a Django model."""

from django.db import models


class Order(models.Model):
    email = models.TextField()
    item = models.TextField()
    quantity = models.IntegerField()

    class Meta:
        db_table = "orders"
        managed = False  # created by migrations/0001_orders.py, shared with the other examples
