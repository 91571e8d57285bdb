"""``persistent_jobs_insert()``: the insert of a job without a dedup key, as a PL/pgSQL function.

``enqueue()`` of a plain job sends one ``SELECT persistent_jobs_insert(...)`` instead of a
text ``INSERT``. PL/pgSQL keeps the plan of the ``INSERT`` inside the function for the life of
the database session, so PostgreSQL no longer parses, analyses and plans a thirteen-column
insert with a ``RETURNING`` list on every call (a fifth of what a lone enqueue costs the
server); unlike a prepared statement, that cache lives in the server session itself, so it is
safe behind any connection pooler. The function returns only what the server decided (the due
time and the creation time); ``enqueue()`` builds the rest of the job from what it sent.

Its parameters are ``enqueuing._INSERT_COLUMNS`` in that order; the due time is computed here
as in the text insert (``run_at``, or the transaction's ``now()`` plus ``delay`` seconds).
The insert still fires the NOTIFY trigger of migration 0002.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION persistent_jobs_insert(
    p_id uuid, p_job_type text, p_payload jsonb, p_queue text, p_priority integer,
    p_max_retries integer, p_run_at timestamptz, p_delay float8, p_timeout float8,
    p_dedup_key text, p_dedup text, p_schedule jsonb, p_tenant text
) RETURNS timestamptz[]
LANGUAGE plpgsql AS $$
DECLARE
    due timestamptz;
    created timestamptz;
BEGIN
    INSERT INTO persistent_jobs (id, job_type, payload, queue, priority, max_retries,
        next_run_at, timeout_seconds, dedup_key, dedup, schedule, tenant)
    VALUES (p_id, p_job_type, p_payload, p_queue, p_priority, p_max_retries,
        COALESCE(p_run_at, now() + p_delay * interval '1 second'), p_timeout, p_dedup_key,
        p_dedup, p_schedule, p_tenant)
    RETURNING next_run_at, created_at INTO due, created;
    RETURN ARRAY[due, created];
END;
$$;
"""

DROP = """
DROP FUNCTION IF EXISTS persistent_jobs_insert(uuid, text, jsonb, text, integer, integer,
    timestamptz, float8, float8, text, text, jsonb, text);
"""


class Migration(migrations.Migration):
    dependencies = [("django_persistent_jobs", "0011_attempt_started")]
    operations = [migrations.RunSQL(CREATE, DROP)]
