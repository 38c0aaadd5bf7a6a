"""The orders and emails tables (examples/orders.py's, shared with the other examples).

The outbox has its own versioned migrations: ``python -m aiooutbox migrate`` (or the
consumer's ``run … --migrate``) applies them.
"""

from typing import Any, ClassVar

from django.db import migrations, models

from examples.orders import TABLES


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunSQL(TABLES, reverse_sql=migrations.RunSQL.noop),
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("email", models.TextField()),
                ("item", models.TextField()),
                ("quantity", models.IntegerField()),
            ],
            options={"db_table": "orders", "managed": False},
        ),
    ]
