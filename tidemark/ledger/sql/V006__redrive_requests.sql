-- A redrive request: the dead letters one redrive replays, chosen once (by ids, or by a
-- filter evaluated here), with who asked. The Dead letters page, the redrive DAG's select
-- task and `tidemark dlq redrive` create it; the Spark job and its task get only its id and
-- read the letters from here (an id list on a command line, in a DAG run's conf or in a
-- task's spec breaks at tens of thousands of ids).
CREATE TABLE tidemark.redrive_requests (
    request_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pipeline     text NOT NULL,
    requested_by text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    selection    jsonb NOT NULL,          -- what was asked: {"ids": n} or the filters
    letters      integer NOT NULL         -- how many letters it holds
);

-- One row per letter of a request; no foreign key to tidemark.dlq: an id that does not exist
-- is kept and reported as such by the redrive.
CREATE TABLE tidemark.redrive_letters (
    request_id bigint NOT NULL REFERENCES tidemark.redrive_requests ON DELETE CASCADE,
    letter_id  bigint NOT NULL,
    PRIMARY KEY (request_id, letter_id)
);
