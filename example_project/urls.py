"""The example project's URLs: the admin, and the admin's static files.

Static files are served by Django here whatever ``DEBUG`` says, so that the demo's admin is
styled in its default configuration (DEBUG off) with nothing else to install. A real deployment
serves ``collectstatic``'s output from its web server, a CDN or WhiteNoise instead: Django's
static view is simple, not fast.
"""

from django.contrib import admin
from django.contrib.staticfiles.views import serve
from django.urls import path, re_path

urlpatterns = [
    path("admin/", admin.site.urls),
    re_path(r"^static/(?P<path>.*)$", serve, {"insecure": True}),
]
