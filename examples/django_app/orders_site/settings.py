"""Settings: one PostgreSQL database from ``AIOOUTBOX_DSN`` (or ``DATABASE_URL``)."""

from urllib.parse import parse_qs, unquote, urlsplit

from examples.orders import database_url

_dsn = urlsplit(database_url())

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["examples.django_app.orders_site"]
MIDDLEWARE: list[str] = []  # a JSON API without sessions, auth or CSRF
ROOT_URLCONF = "examples.django_app.orders_site.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _dsn.path.lstrip("/") or "postgres",
        "USER": unquote(_dsn.username or "postgres"),
        "PASSWORD": unquote(_dsn.password or ""),
        # a Unix-socket DSN names its directory in ?host= (the embedded server does)
        "HOST": parse_qs(_dsn.query).get("host", [_dsn.hostname or "127.0.0.1"])[0],
        "PORT": parse_qs(_dsn.query).get("port", [str(_dsn.port or 5432)])[0],
    }
}
