"""``persistent_jobs_attempts.started``: whether a claimed job's handler was given to a worker.

A runner that claims more jobs than it has free workers (``PREFETCH``) records the extra ones as
waiting; if it dies, they are handed back uncharged instead of being charged an attempt that
never ran. The column has a constant default, so adding it rewrites nothing (PostgreSQL 11+)
and existing rows read as started.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_persistent_jobs", "0010_hot_path_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobattempt",
            name="started",
            field=models.BooleanField(
                db_default=True, default=True,
                help_text="False while the claimed job waits in its runner for a free worker.",
            ),
        ),
    ]
