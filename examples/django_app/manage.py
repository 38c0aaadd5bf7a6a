#!/usr/bin/env python
"""Django's command line for the orders site: ``python examples/django_app/manage.py …``."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # the site lives in the examples package and reuses examples/orders.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_app.orders_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
