"""Settings of the scratch project that measures django-tasks-db (not part of the package)."""

SECRET_KEY = "measure-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes", "django.contrib.auth", "django.contrib.admin",
    "django.contrib.sessions", "django.contrib.messages", "django_tasks_db", "measure",
]
DATABASES = {"default": {
    "ENGINE": "django.db.backends.postgresql", "NAME": "tasks_db_measure", "USER": "postgres",
    "HOST": "127.0.0.1",
}}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
SILENCED_SYSTEM_CHECKS = ["admin.E403", "admin.E408", "admin.E409", "admin.E410"]
