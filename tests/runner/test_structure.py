"""The runner's structure, as issue 9 asks: the supervisor is the composition root, and none of
the loops or services it builds imports it back, not even for type checking, so each one's
parameters say everything it can touch."""

from __future__ import annotations

import ast
from pathlib import Path

import django_persistent_jobs.runner as runner_package

RUNNER = Path(runner_package.__file__).parent
#: The package's lazy ``Runner`` export, and the composition root itself.
ALLOWED = {"__init__.py", "supervisor.py"}


def _imports_supervisor(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {alias.name for alias in node.names}
            if module.endswith("supervisor") or (module in ("", "runner", "..runner")
                                                  and "supervisor" in names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(
                alias.name.endswith(".supervisor") for alias in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_loop_or_service_imports_the_supervisor() -> None:
    modules = [p for p in RUNNER.rglob("*.py") if p.name not in ALLOWED or p.parent != RUNNER]
    assert any(p.name == "claimer.py" for p in modules)
    offenders = {str(p.relative_to(RUNNER)): lines for p in modules
                 if (lines := _imports_supervisor(p))}
    assert offenders == {}


def test_the_check_sees_an_import_of_the_supervisor(tmp_path: Path) -> None:
    sample = tmp_path / "loop.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .supervisor import Runner\nfrom . import supervisor\n")
    assert _imports_supervisor(sample) == [3, 4]
