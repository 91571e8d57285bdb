"""NOTIFY on insert, once per statement, carrying one due job's id.

A statement-level trigger with a transition table sends a single wake-up for ``enqueue_many``
however many rows it inserts; runners then claim as many jobs as they have slots. PostgreSQL
delivers the notification only if the transaction commits, which keeps enqueue transactional.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION persistent_jobs_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    due_id uuid;
BEGIN
    SELECT id INTO due_id FROM new_rows
    WHERE status = 'pending' AND next_run_at <= now() LIMIT 1;
    IF due_id IS NOT NULL THEN
        PERFORM pg_notify('persistent_jobs', due_id::text);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER persistent_jobs_notify_insert
AFTER INSERT ON persistent_jobs
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION persistent_jobs_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS persistent_jobs_notify_insert ON persistent_jobs;
DROP FUNCTION IF EXISTS persistent_jobs_notify();
"""


class Migration(migrations.Migration):
    dependencies = [("django_persistent_jobs", "0001_initial")]
    operations = [migrations.RunSQL(CREATE, DROP)]
