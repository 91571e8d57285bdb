"""The operator HTTP API: plain Django views over the service layer (see ``docs/api.md``).

Kept import-light: ``models/__init__.py`` imports ``api.tokens`` while the app registry is
loading.
"""
