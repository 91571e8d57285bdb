"""Indexes the runner's hot path maintains for nothing.

Every claim inserts an attempt row and every completion updates it and the job; a status change
is never a HOT update (status is in the partial indexes' predicates), so each of these writes
adds an entry to every index that covers the row:

- ``persistent_jobs_attempts.job_id`` had the foreign key's own index next to
  ``pj_attempt_job_idx (job_id, attempt)``, which serves every lookup by job (and the cascade).
- ``pj_type_status_idx (job_type, status)`` took an entry at the claim (running) and another at
  the completion (completed); it now holds only the statuses it is looked up by.

Two index entries fewer per job on each table. The indexes are built and dropped concurrently,
so the migration does not block writers on a large job table.
"""

import django.db.models.deletion
from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_persistent_jobs", "0009_api_tokens"),
    ]

    operations = [
        RemoveIndexConcurrently(
            model_name="persistentjob",
            name="pj_type_status_idx",
        ),
        AddIndexConcurrently(
            model_name="persistentjob",
            index=models.Index(
                condition=models.Q(("status__in", ("pending", "failed", "dead_lettered",
                                                   "cancelled"))),
                fields=["job_type", "status"], name="pj_type_status_idx",
            ),
        ),
        migrations.AlterField(
            model_name="jobattempt",
            name="job",
            field=models.ForeignKey(
                db_index=False, on_delete=django.db.models.deletion.CASCADE,
                related_name="attempt_set", to="django_persistent_jobs.persistentjob",
            ),
        ),
    ]
