from django.db import migrations, models


class Migration(migrations.Migration):
    """Runners list the job types they have handlers for (a runner claims only those), so that
    the console can tell a job no live runner will ever claim from one that is merely late."""

    dependencies = [
        ('django_persistent_jobs', '0012_insert_function'),
    ]

    operations = [
        migrations.AddField(
            model_name='jobrunnerrecord',
            name='job_types',
            field=models.JSONField(blank=True, null=True),
        ),
    ]
