"""Django admin for recurring schedules: see when each fires and how it last went; steer it.

Every write goes through ``schedules.services`` (the same validation and behaviour as the Python
API). Schedules declared in code are read-only here except for pause, resume and "run now":
changing them belongs in the ``@job_handler`` decorator, where the next deploy would put them
back anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import urlencode
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import connections
from django.db.models import OuterRef, QuerySet, Subquery
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone as dj_timezone
from django.utils.html import format_html

from .. import conf
from ..handlers import registry
from ..models import JobSchedule, PersistentJob, TickResult
from ..schedules.definition import validate_definition
from ..schedules.services import (
    ScheduleError,
    ScheduleNotFoundError,
    add_schedule,
    gone_from_code,
    pause_schedule,
    remove_schedule,
    resume_schedule,
    run_schedule_now,
    update_schedule,
)
from ..schedules.timing import default_timezone
from . import display
from .database import JobsDatabaseMixin, alias, objects

if TYPE_CHECKING:
    _ScheduleAdminBase = admin.ModelAdmin[JobSchedule]
else:
    _ScheduleAdminBase = admin.ModelAdmin

_DEFINITION_FIELDS = ("name", "job_type", "cron", "interval_seconds", "timezone", "payload",
                      "queue", "priority", "paused")
_INFO_FIELDS = ("source", "active", "inactive_reason", "next_run", "last_run_at", "last_outcome",
                "last_error", "runs", "created_at", "updated_at")


def _in_zone(value: Any, zone: str | None) -> str:
    if value is None:
        return "-"
    try:
        tz = ZoneInfo(zone) if zone else dj_timezone.get_current_timezone()
    except (ZoneInfoNotFoundError, ValueError):
        tz = dj_timezone.get_current_timezone()
    shown: str = value.astimezone(tz).strftime("%Y-%m-%d %H:%M:%S %Z")
    return shown


def runs_url(name: str) -> str:
    """The job changelist narrowed to this schedule's runs: the jobs whose ``schedule`` record
    (written on every run it enqueues) names it. A search for the name (``?q=``) also listed
    other schedules' runs whose names contain it, and jobs whose dedup key or type contains it:
    for a code schedule, named after its job type, every job of the type."""
    return (reverse("admin:django_persistent_jobs_persistentjob_changelist") + "?"
            + urlencode({"schedule__name": name}))


def schedule_link(job: PersistentJob) -> str:
    """For the job detail page: a link to the schedule that enqueued this run, if any."""
    info = job.schedule if isinstance(job.schedule, dict) else None
    if not info or not info.get("name"):
        return "-"
    name = str(info["name"])
    when = info.get("tick") or "run now"
    schedule = objects(JobSchedule).filter(name=name).only("pk").first()
    if schedule is None:
        return format_html("{} (schedule removed; tick {})", name, when)
    url = reverse("admin:django_persistent_jobs_jobschedule_change", args=[schedule.pk])
    return format_html('<a href="{}">{}</a> (tick {})', url, name, when)


if TYPE_CHECKING:
    _ScheduleFormBase: TypeAlias = forms.ModelForm[JobSchedule]
else:  # ModelForm is not subscriptable at run time
    _ScheduleFormBase = forms.ModelForm


def definition_version(pk: Any) -> str | None:
    """A digest of what the change form edits of schedule ``pk`` as stored now (its definition
    and ``paused``), or None if there is no such row. Computed by PostgreSQL from the stored
    values, so any payload it holds is digested. What firing changes (next and last run,
    ``updated_at``) is left out: a tick while the form is open is no conflict."""
    connection = connections[alias()]
    quote = connection.ops.quote_name
    column_of = {field.name: field.column or field.name
                 for field in JobSchedule._meta.concrete_fields}
    columns = ", ".join(quote(column_of[name]) for name in _DEFINITION_FIELDS)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT md5(ROW({columns})::text) FROM "
                       f"{quote(JobSchedule._meta.db_table)} WHERE id = %s", [pk])
        row = cursor.fetchone()
    return str(row[0]) if row else None


class PayloadField(forms.JSONField):
    """The payload box. A JSON integer longer than Python reads (``sys.get_int_max_str_digits``,
    4300 digits) made ``json.loads`` raise a ``ValueError`` that Django's field does not catch:
    a 500 when the form was cleaned, and again when it was drawn with the error. Now it is a form
    error, and the box keeps what was typed."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except ValueError as exc:  # (a JSONDecodeError is already a ValidationError)
            raise ValidationError(f"The payload is not usable JSON: {exc}.",
                                  code="invalid") from exc

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except ValueError:
            return InvalidJSONInput(data)


class JobScheduleForm(_ScheduleFormBase):
    """Validates with the same function the Python API uses, so the messages match.

    The change form carries the digest of the schedule as it was drawn (``version``) and refuses
    to save if the stored schedule has changed since: a form opened before someone else paused
    the schedule during an incident resumed it when saved for a payload edit (its unticked
    *paused* box differed from the row), and overwrote any definition edited meanwhile.
    """

    version = forms.CharField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = JobSchedule
        fields = _DEFINITION_FIELDS
        field_classes = {"payload": PayloadField}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "job_type" in self.fields and not conf.settings.ALLOW_UNREGISTERED:
            choices = [(t, t) for t in registry.job_types()]
            self.fields["job_type"] = forms.ChoiceField(choices=choices, label="Job type")
        if "timezone" in self.fields:
            self.fields["timezone"].initial = default_timezone()
        if "interval_seconds" in self.fields:
            self.fields["interval_seconds"].help_text = "Seconds; give this or cron, not both."
        if self.instance.pk is not None and "version" in self.fields:
            self.fields["version"].initial = definition_version(self.instance.pk)
        if self.instance.pk is not None and "paused" in self.fields:
            # The box's value as drawn goes back with the form, and "changed" is judged
            # against it, not against the row at save time: a post that does not carry it
            # (no version either) never resumes a schedule paused meanwhile.
            self.fields["paused"].show_hidden_initial = True

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        seen = data.get("version")
        if self.instance.pk is not None and seen and seen != definition_version(
                self.instance.pk):
            raise ValidationError(
                "This schedule was changed since this page was drawn (by someone else, or in "
                "another tab): saving would undo that change, a pause included. Nothing was "
                "saved. Reload the page to see the schedule as it is now, then make your change "
                "again.")
        if not {"job_type", "cron"} <= set(self.fields):
            return data
        try:
            validate_definition(
                data.get("job_type"), cron=data.get("cron") or None,
                interval=data.get("interval_seconds"), payload=data.get("payload"),
                timezone=data.get("timezone") or None, queue=data.get("queue") or None,
                priority=data.get("priority"),
            )
        except ScheduleError as exc:
            raise ValidationError(str(exc)) from exc
        return data

    def validate_unique(self) -> None:
        """The name is unique in the jobs database. Django's own check reads the default
        manager, which is the ``default`` database: with the schedules elsewhere a taken name
        passed the form and ``add_schedule`` refused it with a 500."""
        name = self.cleaned_data.get("name")
        if "name" not in self.fields or not name:
            return
        if objects(JobSchedule).filter(name=name).exclude(pk=self.instance.pk).exists():
            self.add_error("name", self.instance.unique_error_message(JobSchedule, ("name",)))


@admin.register(JobSchedule)
class JobScheduleAdmin(JobsDatabaseMixin[JobSchedule], _ScheduleAdminBase):
    form = JobScheduleForm
    list_display = ("name", "job_type", "expression", "zone", "next_run", "last_run_at",
                    "last_outcome", "state", "source")
    list_filter = ("source", "active", "paused", "last_result")
    allowed_lookups = frozenset({f"{name}__{lookup}" for name in list_filter
                                 for lookup in ("exact", "isnull")}
                                | set(list_filter))
    search_fields = ("name", "job_type")
    actions = ["pause", "resume", "run_now"]
    ordering = ("name",)

    # ------------------------------------------------------------------ queryset and columns
    def get_queryset(self, request: HttpRequest) -> QuerySet[JobSchedule]:
        last_status = objects(PersistentJob).filter(id=OuterRef("last_job_id")).values("status")
        return super().get_queryset(request).annotate(last_job_status=Subquery(last_status[:1]))

    @admin.display(description="schedule")
    def expression(self, obj: JobSchedule) -> str:
        return obj.describe().split(" (")[0]

    @admin.display(description="time zone", ordering="timezone")
    def zone(self, obj: JobSchedule) -> str:
        return obj.timezone if obj.cron else "-"

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, obj: JobSchedule) -> str:
        if not obj.active or obj.paused:
            return "-"
        return _in_zone(obj.next_run_at, obj.timezone if obj.cron else None)

    @admin.display(description="last outcome", ordering="last_result")
    def last_outcome(self, obj: JobSchedule) -> str:
        if not obj.last_result:
            return "-"
        status = getattr(obj, "last_job_status", None)
        if obj.last_job_id is None:
            return TickResult(obj.last_result).label
        url = reverse("admin:django_persistent_jobs_persistentjob_change", args=[obj.last_job_id])
        label = {"enqueued": "run", "skipped": "skipped; active run"}.get(obj.last_result,
                                                                         obj.last_result)
        return format_html('{} <a href="{}">{}</a>', label, url,
                           status or "deleted by cleanup")

    @admin.display(description="state")
    def state(self, obj: JobSchedule) -> str:
        if not obj.active:
            return f"inactive: {obj.get_inactive_reason_display()}"
        return "paused" if obj.paused else "active"

    @admin.display(description="runs")
    def runs(self, obj: JobSchedule) -> str:
        if obj.pk is None:
            return "-"
        return format_html('<a href="{}">runs of {}</a>', runs_url(obj.name), obj.name)

    @admin.display(description="payload")
    def shown_payload(self, obj: JobSchedule) -> str:
        return format_html('<pre class="pj-pre">{}</pre>',
                           display.pretty_json(display.redact(obj.payload)))

    # ------------------------------------------------------------------ editing
    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        """Where the payload is only shown (a code schedule, a user who may not change it),
        it is redacted as on the job page (``REDACT_KEYS``). Who may edit it sees it whole:
        the form saves what it shows."""
        fields = [f for f in super().get_fields(request, obj) if f != "shown_payload"]
        if obj is None or not self.has_change_permission(request, obj):
            fields = [f for f in fields if f != "version"]  # (only a change form has one)
        if obj is not None and not self.has_change_permission(request, obj):
            fields = ["shown_payload" if f == "payload" else f for f in fields]
        return fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return _INFO_FIELDS
        if obj.is_code:
            return _DEFINITION_FIELDS + _INFO_FIELDS + ("shown_payload",)
        return ("name", *_INFO_FIELDS, "shown_payload")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A code-declared schedule's page is view-only (its actions stay available in the list).
        if obj is not None and obj.is_code:
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A code schedule comes back with the next sync, unless the code no longer has it.
        if obj is not None and obj.is_code and not gone_from_code(obj):
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: JobSchedule, form: Any, change: bool) -> None:
        data = form.cleaned_data
        definition = {
            "cron": data.get("cron") or None, "interval": data.get("interval_seconds"),
            "payload": data.get("payload"), "timezone": data.get("timezone") or None,
            "queue": data.get("queue") or None, "priority": data.get("priority"),
        }
        if not change:
            saved = add_schedule(obj.name, data["job_type"], paused=bool(data.get("paused")),
                                 **definition)
        else:
            saved = update_schedule(obj.name, job_type=data["job_type"], **definition)
            if "paused" in form.changed_data:
                saved = (pause_schedule if data.get("paused") else resume_schedule)(obj.name)
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: JobSchedule) -> None:
        remove_schedule(obj.name)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[JobSchedule]) -> None:
        for schedule in queryset:
            try:
                remove_schedule(schedule.name)
            except (ScheduleError, ScheduleNotFoundError) as exc:
                self.message_user(request, str(exc), messages.WARNING)

    # ------------------------------------------------------------------ actions
    def _each(self, request: HttpRequest, queryset: QuerySet[JobSchedule], verb: str,
              action: Any) -> None:
        done = 0
        for name in queryset.values_list("name", flat=True):
            try:
                action(name)
                done += 1
            except (ScheduleError, ScheduleNotFoundError) as exc:
                self.message_user(request, str(exc), messages.WARNING)
        if done:
            self.message_user(request, f"{verb} {done} schedule(s).", messages.SUCCESS)

    @admin.action(description="Pause", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[JobSchedule]) -> None:
        self._each(request, queryset, "Paused", pause_schedule)

    @admin.action(description="Resume (from the next tick)", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[JobSchedule]) -> None:
        self._each(request, queryset, "Resumed", resume_schedule)

    @admin.action(description="Run now", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[JobSchedule]) -> None:
        for name in queryset.values_list("name", flat=True):
            try:
                job = run_schedule_now(name)
            except (ScheduleError, ScheduleNotFoundError) as exc:
                self.message_user(request, str(exc), messages.WARNING)
                continue
            schedule = objects(JobSchedule).get(name=name)
            if schedule.last_result == TickResult.SKIPPED:
                self.message_user(request, f"{name}: skipped, run {job.id} is still {job.status} "
                                           "(the handler's dedup is Skip).", messages.WARNING)
            else:
                self.message_user(request, f"{name}: enqueued run {job.id}.", messages.SUCCESS)
