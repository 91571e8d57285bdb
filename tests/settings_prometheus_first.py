"""The test settings, for a runner subprocess in which prometheus_client is imported (and an
application metric created) before ``runjobs`` can choose prometheus_client's mode, as an app
such as django-prometheus in ``INSTALLED_APPS`` does at start-up."""

from __future__ import annotations

import prometheus_client

from tests.settings import *  # noqa: F403

#: An application's own metric, made at import like django-prometheus's.
APP_REQUESTS = prometheus_client.Counter("pj_tests_app_requests", "An application's metric.")
