from django.db import migrations, models


class Migration(migrations.Migration):
    """Runners list the schedules their code declares, so that a sync can tell a schedule
    removed from the code from one that only an older (or newer) runner lacks."""

    dependencies = [
        ('django_persistent_jobs', '0013_runner_job_types'),
    ]

    operations = [
        migrations.AddField(
            model_name='jobrunnerrecord',
            name='schedules',
            field=models.JSONField(blank=True, null=True),
        ),
    ]
