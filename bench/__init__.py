"""Benchmarks for django-persistent-jobs: ``python bench/run.py`` prints every figure in one run.

This package is also a tiny Django app (``bench``) so that ``runjobs`` subprocesses started by the
benchmark find its handlers through the normal ``jobs`` autodiscovery. It is not a test suite.
"""
