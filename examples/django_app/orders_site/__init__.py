"""A minimal Django site whose view writes an order and its event in one ``atomic()``."""
