"""Every log ``event`` the package emits is documented, and the event tables list no stale ones.

Log records carry a machine-readable ``event`` in ``extra`` (operations.md, "Logging"), which
operators filter and alert on: an event missing from the docs is one nobody knows to watch, and
a row for an event the code no longer logs is an alert that never fires. Reads the source and
the Markdown only: no database.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_persistent_jobs"
DOCS = ROOT / "docs"
#: The event tables: (file, the first cell of the table's header row). Each row's event (every
#: backticked name in its first cell) must be one the code logs.
EVENT_TABLES = (
    ("operations.md", "`event`"),
    ("processes.md", "Event"),
    ("recurring.md", "Event"),
)


def _choices(module: str, class_name: str) -> tuple[str, ...]:
    """The values of a ``TextChoices`` class, read from its source."""
    tree = ast.parse((PACKAGE / module).read_text())
    cls = next(node for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name == class_name)
    return tuple(ast.literal_eval(node.value)[0] for node in cls.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple))


#: The values a placeholder of an f-string event takes: ``f"schedule_{result}"`` in
#: ``runner/scheduler.py``, where ``result`` is what a tick did.
PLACEHOLDERS = {"result": _choices("models/schedules.py", "TickResult")}


class _Unresolved(Exception):
    """An ``event`` value the scan cannot read as a literal name (or a table of them)."""


def _names(node: ast.expr) -> list[str]:
    """The event names an ``event`` value can take."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):  # f"schedule_{result}": each value of each placeholder
        names = [""]
        for part in node.values:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                names = [name + part.value for name in names]
            elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name)
                  and part.value.id in PLACEHOLDERS):
                names = [name + value for name in names for value in PLACEHOLDERS[part.value.id]]
            else:
                raise _Unresolved(ast.unparse(node))
        return names
    if isinstance(node, ast.Dict):  # a lookup table: {"failed": "retry", ...}[status]
        return [name for value in node.values for name in _names(value)]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return _names(node.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and isinstance(node.func.value, ast.Dict)):
        # {...}.get(key, default): the table's values and the default
        return [name for arg in (node.func.value, *node.args[1:]) for name in _names(arg)]
    if isinstance(node, ast.IfExp):
        return _names(node.body) + _names(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [name for value in node.values for name in _names(value)]
    raise _Unresolved(ast.unparse(node))


def _is_event_key(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == "event"


@functools.cache
def logged_events() -> dict[str, list[str]]:
    """Every name given as ``event`` anywhere in the package, with where: ``{"event": ...}``
    dict literals (``extra={...}``, an ``extra`` dict built first, a ``{**extra, "event": ...}``
    override), ``extra["event"] = ...`` and ``event=...`` keywords."""
    names: dict[str, list[str]] = {}
    unresolved: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.Dict):
                values = [v for k, v in zip(node.keys, node.values, strict=True)
                          if _is_event_key(k)]
            elif isinstance(node, ast.Assign):
                values = [node.value for target in node.targets
                          if isinstance(target, ast.Subscript) and _is_event_key(target.slice)]
            elif isinstance(node, ast.Call):
                values = [kw.value for kw in node.keywords if kw.arg == "event"]
            for value in values:
                where = f"{path.relative_to(ROOT)}:{value.lineno}"
                try:
                    found = _names(value)
                except _Unresolved as exc:
                    unresolved.append(f"{where}: {exc}")
                    continue
                for name in found:
                    names.setdefault(name, []).append(where)
    assert not unresolved, (
        "this test cannot read these `event` values as literal names; log a literal (or "
        "teach _names() the form):\n  " + "\n  ".join(unresolved))
    return names


def documented_names() -> set[str]:
    """Every backticked identifier in docs/*.md."""
    text = "\n".join(path.read_text() for path in sorted(DOCS.glob("*.md")))
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", text))


def table_events(filename: str, header: str) -> dict[str, int]:
    """The events listed in the first column of the table whose header starts with
    ``| header |``, with their line numbers."""
    lines = (DOCS / filename).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"| {header} |")]
    assert len(starts) == 1, f"docs/{filename}: expected one table headed {header!r}"
    events: dict[str, int] = {}
    for number, line in enumerate(lines[starts[0] + 2:], start=starts[0] + 3):
        if not line.startswith("|"):
            break
        first_cell = line.split("|")[1]
        names = re.findall(r"`([a-z][a-z0-9_]*)`", first_cell)
        assert names, f"docs/{filename}:{number}: a row without an event: {line}"
        for name in names:
            events[name] = number
    return events


def test_the_scan_finds_every_form_the_package_logs_an_event_in() -> None:
    names = logged_events()
    # one of each form, so a scan that silently stopped finding one would fail here
    assert "runner_started" in names  # extra={"event": "runner_started", ...}
    assert "dead_letter" in names and "claim_lost" in names  # a lookup table and its default
    assert "completed_unacknowledged" in names  # extra["event"] = ...
    assert "failure" in names  # {**extra, "event": "failure"}
    assert {"schedule_enqueued", "schedule_skipped", "schedule_error"} <= set(names)  # f-string
    assert len(names) > 50


def test_every_logged_event_is_documented() -> None:
    documented = documented_names()
    missing = sorted(f"{name} ({', '.join(where)})" for name, where in logged_events().items()
                     if name not in documented)
    assert not missing, (
        f"{len(missing)} log event(s) the code logs are not documented in docs/*.md (add a row "
        "to the event table of operations.md, processes.md or recurring.md):\n  "
        + "\n  ".join(missing))


@pytest.mark.parametrize(("filename", "header"), EVENT_TABLES)
def test_every_event_in_a_docs_table_is_logged(filename: str, header: str) -> None:
    names = logged_events()
    stale = sorted(f"{name} (docs/{filename}:{line})"
                   for name, line in table_events(filename, header).items() if name not in names)
    assert not stale, (f"docs/{filename} lists log event(s) the code does not log:\n  "
                       + "\n  ".join(stale))


def test_each_event_has_one_row() -> None:
    """One home per event: no event has a row in two tables."""
    seen: dict[str, str] = {}
    twice = []
    for filename, header in EVENT_TABLES:
        for name, line in table_events(filename, header).items():
            if name in seen:
                twice.append(f"{name} (docs/{filename}:{line} and {seen[name]})")
            seen[name] = f"docs/{filename}:{line}"
    assert not twice, "events with rows in two tables:\n  " + "\n  ".join(twice)
