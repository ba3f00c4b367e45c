-- A pipeline's stored config carried its inline DSNs with their passwords (a pg_dump of the
-- ledger showed them). Runs now store it masked (ledger/state.py ensure_pipeline); this masks
-- what earlier runs stored: a URI's userinfo password (to its last '@'), a query's or a
-- key=value password.
UPDATE tidemark.pipelines
SET config = regexp_replace(
        regexp_replace(
            regexp_replace(config::text, '(://[^:/@\s"]*:)[^\s"]*@', '\1***@', 'g'),
            '([?&]password=)[^&#\s"]*', '\1***', 'gi'),
        '(\mpassword\s*=\s*)(''[^'']*''|[^\s"]+)', '\1***', 'gi')::jsonb
WHERE config::text ~* '://[^:/@\s"]*:[^\s"]*@|password';
