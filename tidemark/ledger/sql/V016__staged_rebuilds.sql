-- A sink rebuilt from its pipeline's staged file (`tidemark sink rebuild --staged`;
-- docs/operations.md, "Change a key: stage, rebuild, promote"). Held from just before the
-- rebuild's claim. Until the staged file is promoted, a run of any other version of the
-- pipeline is refused for that sink; once promoted, a run of the version it replaced (a
-- process that read the file before the promotion) still is. So no run of the old file
-- writes into a table rebuilt for the new one, whenever it started. A rebuild that ends
-- without committing releases its hold.
CREATE TABLE tidemark.staged_holds (
    pipeline    text        NOT NULL,
    sink        text        NOT NULL,
    fingerprint text        NOT NULL,  -- the staged version's (config.fingerprint)
    replaces    text        NOT NULL,  -- the live version's when the hold was taken
    held_at     timestamptz NOT NULL DEFAULT now(),
    promoted_at timestamptz,
    PRIMARY KEY (pipeline, sink)
);
