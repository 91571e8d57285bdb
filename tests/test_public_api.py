"""The public surface: every exported name imports, is documented, and ships its types."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import django_persistent_jobs

ROOT = Path(__file__).resolve().parent.parent


def test_every_exported_name_imports_and_is_in_the_reference() -> None:
    reference = (ROOT / "docs" / "reference.md").read_text()
    for name in django_persistent_jobs.__all__:
        assert getattr(django_persistent_jobs, name) is not None
        assert f"`{name}`" in reference, f"{name} is missing from docs/reference.md"


def test_documented_model_and_backend_names_import() -> None:
    models = importlib.import_module("django_persistent_jobs.models")
    for name in ("PersistentJob", "JobStatus", "JobAttempt", "AttemptOutcome",
                 "JobRunnerRecord", "JobSchedule"):
        assert hasattr(models, name), name
    backends = importlib.import_module("django_persistent_jobs.backends")
    for name in backends.__all__:
        assert getattr(backends, name) is not None


def test_the_package_declares_its_annotations() -> None:
    package = Path(django_persistent_jobs.__file__).parent
    assert (package / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


def test_every_package_and_backend_name_is_in_the_index_and_the_reference() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    reference = (ROOT / "docs" / "reference.md").read_text()
    backends = importlib.import_module("django_persistent_jobs.backends")
    for name in django_persistent_jobs.__all__:
        assert re.search(rf"\b{name}\b", index), f"{name} is missing from docs/index.md"
    for name in backends.__all__:
        assert re.search(rf"\b{name}\b", index), f"{name} is missing from docs/index.md"
        assert f"backends.{name}`" in reference, f"{name} is missing from docs/reference.md"


def test_every_models_and_errors_name_is_in_the_reference() -> None:
    reference = (ROOT / "docs" / "reference.md").read_text()
    for module in ("django_persistent_jobs.models", "django_persistent_jobs.errors"):
        for name in importlib.import_module(module).__all__:
            assert re.search(rf"`{name}\b", reference), (
                f"{module}.{name} is missing from docs/reference.md")
