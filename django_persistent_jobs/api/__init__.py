"""The operator HTTP API: plain Django views over the service layer (see ``docs/api.md``).

Kept import-light: ``models.py`` imports ``api.tokens`` while the app registry is loading.
"""
