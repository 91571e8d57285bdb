"""Settings of a worker-only project: the suite's, without any ``django.contrib`` app.

A service that only runs jobs has no users, admin or sessions; the app must install, migrate,
pass its checks and run jobs there. Its URLconf serves the operator API, so ``manage.py check``
imports the API's views too.
"""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS as _SUITE_APPS

INSTALLED_APPS = [app for app in _SUITE_APPS if not app.startswith("django.contrib.")]
MIDDLEWARE: list[str] = []
TEMPLATES: list[dict[str, object]] = []
ROOT_URLCONF = "tests.urls_worker_only"
