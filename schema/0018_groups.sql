-- aiooutbox 0018: groups (fair claims across tenants).
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of earlier schemas keep working: `claim_v6` and `claim_limited_v2` keep
-- their signatures and results and now run the claims below (their rows are served
-- fairly too; they just don't read the group). `claim_limited` (schemas 10 to 15) and
-- the older claims are left as they were: they still claim correctly, but read a
-- topic's whole claimable range to sort it (the index below no longer gives them
-- `(available_at, id)` order within a topic), so upgrade such consumers promptly. A later
-- migration that replaces `claim_v7`, `claim_limited_v3` or `fair_rows` starts from the
-- body below. ALTER TABLE ADD COLUMN is instant. The new claimable index is built
-- CONCURRENTLY, in a step of its own outside a transaction: producers and consumers of
-- the previous schema keep writing while it reads the table (the first step is written
-- to run again if the build was interrupted; the runner rebuilds an index a cancelled
-- build left invalid, and records the migration only after the last step).
--
-- 1. `grp`: an event's group (a tenant, a customer), NULL for none. Compared by code
--    point (COLLATE "C"), so "tenant-1" and a look-alike in another script are two
--    groups, and the claim's turn order is the same for every database collation.
-- 2. The claimable index is `(topic, coalesce(grp, ''), available_at, id)` (it keeps
--    its name): the ungrouped rows of a topic are one range of it, first and ordered as
--    before, and each group is a range of its own, so a claim reaches a group's oldest
--    rows in one descent. (`coalesce`, because PostgreSQL reads `grp IS NULL` as no
--    equality: an index on `grp` itself could not give the ungrouped rows in order. No
--    group is empty, so '' is the ungrouped rows' alone.)
-- 3. `fair_rows`: a topic's candidates, groups in turn. The groups after the consumer's
--    cursor, in name order, found by a skip scan (one descent per group), at most
--    `p_groups` and no more than the claim's size, then, wrapping around, the ungrouped
--    rows (one turn like a group) and the groups up to the cursor. Each gives its oldest
--    due rows, up to its share of twice the claim, ranked in it: the claim takes every
--    group's first row, then every group's second, and so on. A group with a backlog
--    therefore takes one turn per claim, and any group with work is served within
--    ceil(groups with work / groups per claim) claims. The cursor moves on with the
--    groups a claim served (the consumer keeps it). Every group's range is read from
--    the consumer's watermark (`p_after_at`, `p_after_id`), as every topic's is: a row
--    behind it waits for the consumer's next full claim, as before.
-- 4. `claim_v7`: `claim_v6` with the group of each row, and the cursor and the number
--    of groups per claim as arguments. A claim of topics without named groups is the
--    claim it was (the ungrouped range, from the watermark), after one index descent
--    that finds no group. Heads and runs of ordering keys are chosen as before.
-- 5. `claim_limited_v3`: `claim_limited_v2`, its rows chosen by `fair_rows` too, with
--    the group of each row.

ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN IF NOT EXISTS grp TEXT COLLATE "C";
ALTER TABLE "{{schema}}"."{{table}}" DROP CONSTRAINT IF EXISTS "{{table}}_grp_length",
    ADD CONSTRAINT "{{table}}_grp_length"
    CHECK (grp IS NULL OR octet_length(grp) BETWEEN 1 AND 512) NOT VALID;

-- step: concurrent index
CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_topic_grp_claimable_idx"
    ON "{{schema}}"."{{table}}"
    (topic, (coalesce(grp, '')), available_at, id) WHERE status IN ('pending', 'retry');
-- step: transaction
DROP INDEX "{{schema}}"."{{table}}_topic_claimable_idx";
ALTER INDEX "{{schema}}"."{{table}}_topic_grp_claimable_idx" RENAME TO "{{table}}_topic_claimable_idx";

-- A topic's claimable rows in turn by group (3. above). p_cursor: NULL starts with the
-- ungrouped rows, '' after them (they were served last), else after that group.
CREATE FUNCTION "{{schema}}"."{{table}}_fair_rows"(
    p_topic TEXT, p_cursor TEXT, p_limit INT, p_groups INT, p_after_at TIMESTAMPTZ,
    p_after_id BIGINT)
RETURNS TABLE (id BIGINT, rank BIGINT, pos BIGINT, g TEXT)
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    n INT := greatest(least(p_groups, p_limit), 1);
    found TEXT[];
    visits TEXT[];  -- NULL: the ungrouped rows' turn
    per INT;
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
BEGIN
    found := "{{schema}}"."{{table}}_groups_after"(p_topic, coalesce(p_cursor, ''), n);
    IF p_cursor IS NULL THEN
        visits := array_prepend(NULL::text, found[1:n - 1]);
    ELSE
        visits := found;
        IF cardinality(found) < n THEN
            visits := array_append(visits, NULL::text);
            IF p_cursor <> '' THEN  -- wrap around: the groups up to the cursor
                visits := visits || ARRAY(
                    SELECT g.g FROM unnest("{{schema}}"."{{table}}_groups_after"(
                        p_topic, '', n - cardinality(found) - 1)) AS g(g)
                    WHERE g.g <= p_cursor COLLATE "C");
            END IF;
        END IF;
    END IF;
    per := CASE WHEN cardinality(visits) = 1 THEN p_limit
                ELSE least(p_limit, greatest(1, ceil(2.0 * p_limit / cardinality(visits))::int)) END;
    RETURN QUERY
    SELECT x.id, x.rank, v.pos, coalesce(v.g, '') FROM unnest(visits) WITH ORDINALITY AS v(g, pos)
    CROSS JOIN LATERAL (
        SELECT s.id, row_number() OVER (ORDER BY s.available_at, s.id) AS rank
        FROM ((SELECT c.id, c.available_at FROM "{{schema}}"."{{table}}" AS c
               WHERE v.g IS NULL AND c.status IN ('pending', 'retry') AND c.topic = p_topic
                 AND coalesce(c.grp, '') = '' AND c.available_at <= now()
                 AND (c.available_at, c.id) > (after_at, after_id)
               ORDER BY c.available_at, c.id LIMIT per)
              UNION ALL
              (SELECT c.id, c.available_at FROM "{{schema}}"."{{table}}" AS c
               WHERE c.status IN ('pending', 'retry') AND c.topic = p_topic
                 AND coalesce(c.grp, '') = v.g AND c.available_at <= now()
                 AND (c.available_at, c.id) > (after_at, after_id)
               ORDER BY c.available_at, c.id LIMIT per)) AS s) AS x;
END
$fn$;

-- Up to p_n groups of a topic with claimable rows after p_after, in order: a skip scan
-- of the claimable index, one descent per group.
CREATE FUNCTION "{{schema}}"."{{table}}_groups_after"(p_topic TEXT, p_after TEXT, p_n INT)
RETURNS TEXT[]
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT ARRAY(
        WITH RECURSIVE g(grp, k) AS (
            (SELECT coalesce(c.grp, ''), 1 FROM "{{schema}}"."{{table}}" AS c
             WHERE c.status IN ('pending', 'retry') AND c.topic = p_topic
               AND coalesce(c.grp, '') > p_after AND p_n > 0
             ORDER BY coalesce(c.grp, '') LIMIT 1)
            UNION ALL
            SELECT (SELECT coalesce(c.grp, '') FROM "{{schema}}"."{{table}}" AS c
                    WHERE c.status IN ('pending', 'retry') AND c.topic = p_topic
                      AND coalesce(c.grp, '') > g.grp
                    ORDER BY coalesce(c.grp, '') LIMIT 1), g.k + 1
            FROM g WHERE g.grp IS NOT NULL AND g.k < p_n)
        SELECT g.grp FROM g WHERE g.grp IS NOT NULL)
$fn$;

-- The claim of schema 19 (4. above), from `claim_v6` as 0016 left it.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v7"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL,
    p_cursor TEXT DEFAULT NULL, p_groups INT DEFAULT 32)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               grp TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    topics TEXT[] := p_topics;
    cand BIGINT[];
    heads BIGINT[];
    runs BIGINT[] := '{}';
    run_heads BIGINT[] := '{}';  -- the head each run row was claimed behind
    got INT;
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
    head_bytes BIGINT;
    keyed BOOLEAN;  -- an ordered head was claimed: only then look for runs
    held TEXT[];  -- topics paused or limited (flow control): never claimed here
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(
        pg_catalog.hashtextextended('aiooutbox-flow:{{schema}}.{{table}}', 0));
    -- a statement of its own: its snapshot is taken after the lock
    held := "{{schema}}"."{{table}}_flow_held"();
    IF '' = ANY (held) THEN
        RETURN;  -- every topic is paused
    END IF;
    IF topics IS NOT NULL AND cardinality(held) > 0 THEN
        topics := ARRAY(SELECT x FROM unnest(topics) AS u(x)
                         WHERE x NOT IN (SELECT unnest(held)));
    END IF;
    IF topics IS NULL THEN
        -- every topic with claimable rows: a skip scan over the index's leading column
        topics := ARRAY(
            WITH RECURSIVE t(topic) AS (
                (SELECT c.topic FROM "{{schema}}"."{{table}}" c
                 WHERE c.status IN ('pending', 'retry') ORDER BY c.topic LIMIT 1)
                UNION ALL
                SELECT (SELECT c.topic FROM "{{schema}}"."{{table}}" c
                        WHERE c.status IN ('pending', 'retry') AND c.topic > t.topic
                        ORDER BY c.topic LIMIT 1)
                FROM t WHERE t.topic IS NOT NULL)
            SELECT t.topic FROM t WHERE t.topic IS NOT NULL
                AND t.topic NOT IN (SELECT unnest(held)));
    END IF;
    IF cardinality(topics) = 0 THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" AS c
               WHERE c.status IN ('pending', 'retry') AND c.topic = ANY (topics)
                 AND coalesce(c.grp, '') > '') THEN
        -- named groups: each topic's groups in turn after the cursor, the ungrouped range
        -- one of them (`fair_rows`); a round of every group's first rows, then the
        -- second rows, ..., locked in that order
        cand := ARRAY(
            SELECT f.id FROM unnest(topics) WITH ORDINALITY AS t(topic, i)
            CROSS JOIN LATERAL "{{schema}}"."{{table}}_fair_rows"(
                t.topic, p_cursor, p_limit, p_groups, after_at, after_id) AS f
            ORDER BY f.rank, t.i, f.pos LIMIT 2 * p_limit);
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.ord) - s.size AS before
            FROM (SELECT c.id, u.ord, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM unnest(cand) WITH ORDINALITY AS u(id, ord)
                  JOIN "{{schema}}"."{{table}}" AS c ON c.id = u.id
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                  ORDER BY u.ord LIMIT p_limit FOR UPDATE OF c SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSIF cardinality(topics) = 1 THEN
        -- one topic: lock while scanning, so concurrent consumers skip each other exactly
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.topic = topics[1]
                    AND coalesce(c.grp, '') = ''
                    AND c.available_at <= now()
                    AND (c.available_at, c.id) > (after_at, after_id)
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSE
        -- several: the oldest rows of each topic, merged (twice the limit, so rows other
        -- consumers lock meanwhile still leave enough), then locked in that order
        cand := ARRAY(
            SELECT x.id FROM unnest(topics) AS t(topic) CROSS JOIN LATERAL (
                SELECT c.id, c.available_at FROM "{{schema}}"."{{table}}" AS c
                WHERE c.status IN ('pending', 'retry') AND c.topic = t.topic
                  AND coalesce(c.grp, '') = ''
                  AND c.available_at <= now()
                  AND (c.available_at, c.id) > (after_at, after_id)
                ORDER BY c.available_at, c.id LIMIT p_limit) AS x
            ORDER BY x.available_at, x.id LIMIT 2 * p_limit);
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.id = ANY (cand) AND c.status IN ('pending', 'retry')
                    AND c.available_at <= now()
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    END IF;
    IF heads IS NULL THEN
        RETURN;
    END IF;
    IF keyed AND p_run > 0 AND p_run_rows > 0 AND head_bytes < p_max_bytes THEN
        SELECT coalesce(array_agg(q.id), '{}'), coalesce(array_agg(q.h_id), '{}')
        INTO runs, run_heads FROM (
                SELECT r.id, k.h_id, sum(r.size) OVER (ORDER BY r.pos, k.h_at, k.h_id) AS upto
                FROM (SELECT h.ordering_key AS k, h.available_at AS h_at, h.id AS h_id
                      FROM "{{schema}}"."{{table}}" h
                      WHERE h.id = ANY (heads) AND h.ordering_key IS NOT NULL) AS k
                CROSS JOIN LATERAL (
                    SELECT x.id, x.size, row_number() OVER (ORDER BY x.id) AS pos,
                           bool_and(x.ok) OVER (ORDER BY x.id) AS ok
                    FROM (SELECT w.id, pg_column_size(w.payload) AS size,
                                 (w.available_at <= now()
                                  AND ((p_topics IS NULL AND w.topic NOT IN (SELECT unnest(held)))
                                       OR w.topic IN (SELECT unnest(topics)))) AS ok
                          FROM "{{schema}}"."{{table}}" w
                          WHERE w.ordering_key = k.k AND w.status = 'waiting'
                          ORDER BY w.id LIMIT p_run) AS x) AS r
                WHERE r.ok
                ORDER BY r.pos, k.h_at, k.h_id
                LIMIT p_run_rows) AS q
        WHERE q.upto <= p_max_bytes - head_bytes;
    END IF;
    -- rows the byte cap left out were only locked: the locks end with the statement
    IF cardinality(runs) = 0 THEN
        -- heads only (every unordered claim): no per-row array membership tests
        RETURN QUERY
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
            attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
            lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
            holds_key = e.ordering_key IS NOT NULL
        WHERE e.id = ANY (heads)
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, true, e.grp;
        RETURN;
    END IF;
    -- heads: each joined with whether a run was claimed behind it (set operations, so
    -- no scan of one array per element of the other)
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
        holds_key = e.ordering_key IS NOT NULL AND m.alone
    FROM (SELECT a.id, true AS alone
          FROM (SELECT h.id FROM unnest(heads) AS h(id)
                EXCEPT SELECT x.h FROM unnest(run_heads) AS x(h)) AS a
          UNION ALL
          SELECT DISTINCT x.h, false FROM unnest(run_heads) AS x(h)) AS m
    WHERE e.id = m.id
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, true, e.grp;
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
        holds_key = m.last
    FROM (SELECT x.id, x.id = max(x.id) OVER (PARTITION BY x.h) AS last
          FROM unnest(runs, run_heads) AS x(id, h)) AS m
    WHERE e.id = m.id AND e.status = 'waiting'
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, false, e.grp;
    GET DIAGNOSTICS got = ROW_COUNT;
    IF got < cardinality(runs) THEN
        -- a run row changed between the look and the update (rare): re-flag each key of
        -- this claim on the highest run row actually claimed, else on its head
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id = ANY (heads || runs) AND e.status = 'processing' AND e.locked_by = p_worker
          AND e.holds_key;
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = true
        FROM (SELECT coalesce(max(c.id) FILTER (WHERE c.id = ANY (runs)),
                              max(c.id) FILTER (WHERE c.id = ANY (heads))) AS id
              FROM "{{schema}}"."{{table}}" c
              WHERE c.id = ANY (heads || runs) AND c.status = 'processing'
                AND c.locked_by = p_worker AND c.ordering_key IS NOT NULL
              GROUP BY c.ordering_key) AS f
        WHERE e.id = f.id;
    END IF;
END
$fn$;

-- Consumers of schemas 6 to 18: the claim above, without the group column.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_claim_v6"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT c.id, c.topic, c.payload, c.dedupe_key, c.headers, c.attempts, c.max_attempts,
           c.created_at, c.available_at, c.message_id, c.ordering_key, c.is_head
    FROM "{{schema}}"."{{table}}_claim_v7"(p_worker, p_lease, p_topics, p_limit, p_max_bytes,
                                            p_run, p_run_rows, p_after_at, p_after_id) AS c
$fn$;

-- The claim of limited topics of schema 19 (5. above), from `claim_limited_v2` as 0016
-- left it.

-- 6. Per-group limits. `<table>_group_limits`: a topic's limits for each of its named
--    groups (grp ''), and overrides for some groups (a NULL field takes the topic's
--    default); ungrouped events are held only by the topic's own limits. A topic with
--    any row here is `grouped` in `<table>_flow`, so it is held back from the open
--    claim and claimed through `claim_limited_v3`, which locks its control row: claims
--    of the topic take turns, and each counts a group's running rows (those it
--    claimed, `flow_counted`) in a statement after that lock, so no race exceeds a
--    group's max_running; a SIGKILLed consumer's rows stop counting when lease recovery
--    takes them back. `<table>_group_tokens`: each rate-limited group's bucket, written
--    by the claims (a group's bucket starts full). The claims read and write both
--    through SECURITY DEFINER functions (every name schema-qualified, as 0010's
--    `flow_held`), so consumer roles need no new grant.
ALTER TABLE "{{schema}}"."{{table}}_flow" ADD COLUMN grouped BOOLEAN NOT NULL DEFAULT false;

CREATE TABLE "{{schema}}"."{{table}}_group_limits" (
    topic       TEXT        NOT NULL,
    grp         TEXT        COLLATE "C" NOT NULL,  -- '': every named group of the topic
    max_running INT,
    rate        FLOAT8,
    rate_text   TEXT,
    burst       FLOAT8,
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_by  TEXT        NOT NULL,
    PRIMARY KEY (topic, grp),
    CONSTRAINT "{{table}}_group_limits_max_running" CHECK (max_running IS NULL OR max_running >= 1),
    CONSTRAINT "{{table}}_group_limits_rate" CHECK (
        (rate IS NULL AND burst IS NULL AND rate_text IS NULL)
        OR (rate > 0 AND rate <= 1e6 AND burst >= 1 AND burst <= 1e6 AND rate_text IS NOT NULL)),
    CONSTRAINT "{{table}}_group_limits_set" CHECK (max_running IS NOT NULL OR rate IS NOT NULL)
);

CREATE TABLE "{{schema}}"."{{table}}_group_tokens" (
    topic     TEXT        NOT NULL,
    grp       TEXT        COLLATE "C" NOT NULL,
    tokens    FLOAT8      NOT NULL,
    tokens_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (topic, grp)
);

-- The topics the open claim leaves out: 0010's, and those with group limits.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_flow_held"() RETURNS TEXT[]
LANGUAGE plpgsql STABLE SECURITY DEFINER AS $fn$
BEGIN
    RETURN ARRAY(SELECT f.topic FROM "{{schema}}"."{{table}}_flow" f
                 WHERE f.paused OR f.max_running IS NOT NULL OR f.rate IS NOT NULL
                    OR f.grouped);
END
$fn$;

-- A grouped topic's candidates (`fair_rows`), each group's cut to what its limits allow
-- now: `capped` when a group's max_running cut it, `rate_wait` the seconds until the
-- first group out of tokens has one. Called after the topic's control row is locked.
CREATE FUNCTION "{{schema}}"."{{table}}_group_cands"(
    p_topic TEXT, p_cursor TEXT, p_limit INT, p_groups INT,
    OUT ids BIGINT[], OUT capped BOOLEAN, OUT rate_wait FLOAT8)
LANGUAGE plpgsql SECURITY DEFINER
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    WITH f AS MATERIALIZED (
        SELECT x.id, x.rank, x.pos, x.g FROM "{{schema}}"."{{table}}_fair_rows"(
            p_topic, p_cursor, p_limit, p_groups, NULL, NULL) AS x),
    a AS MATERIALIZED (
        SELECT s.g, s.cands, least(s.free, coalesce(floor(s.tokens)::int, s.free)) AS n,
               s.free < s.cands AND s.free <= coalesce(floor(s.tokens)::int, s.free) AS by_running,
               -- cut by its tokens: it takes floor(tokens) now, its next token comes then
               CASE WHEN s.cands > floor(s.tokens)
                    THEN (1 - (s.tokens - floor(s.tokens))) / s.rate END AS wait
        FROM (SELECT l.g, l.rate, l.cands,
                     CASE WHEN l.mr IS NULL THEN p_limit
                          ELSE greatest(l.mr - (SELECT count(*) FROM "{{schema}}"."{{table}}" r
                                                WHERE r.topic = p_topic AND r.flow_counted
                                                  AND r.status = 'processing'
                                                  AND coalesce(r.grp, '') = l.g), 0)::int
                     END AS free,
                     CASE WHEN l.rate IS NOT NULL THEN
                          least(l.burst, coalesce(t.tokens, l.burst) + l.rate * extract(epoch FROM
                                greatest(pg_catalog.clock_timestamp(), t.tokens_at) - t.tokens_at)::float8)
                     END AS tokens
              FROM (SELECT gs.g, gs.cands, coalesce(o.max_running, d.max_running) AS mr,
                           coalesce(o.rate, d.rate) AS rate, coalesce(o.burst, d.burst) AS burst
                    FROM (SELECT f.g, count(*) AS cands FROM f WHERE f.g <> '' GROUP BY f.g) AS gs
                    LEFT JOIN "{{schema}}"."{{table}}_group_limits" o
                           ON o.topic = p_topic AND o.grp = gs.g
                    LEFT JOIN "{{schema}}"."{{table}}_group_limits" d
                           ON d.topic = p_topic AND d.grp = '') AS l
              LEFT JOIN "{{schema}}"."{{table}}_group_tokens" t
                     ON t.topic = p_topic AND t.grp = l.g
              WHERE l.mr IS NOT NULL OR l.rate IS NOT NULL) AS s)
    SELECT ARRAY(SELECT f.id FROM f LEFT JOIN a ON a.g = f.g
                 WHERE a.g IS NULL OR f.rank <= a.n
                 ORDER BY f.rank, f.pos LIMIT 2 * p_limit),
           coalesce((SELECT bool_or(a.by_running) FROM a), false),
           (SELECT min(a.wait) FROM a)
    INTO ids, capped, rate_wait;
END
$fn$;

-- A grouped topic's claim took `p_ids`: each rate-limited group's bucket pays for its
-- rows (with the refill since it was last written).
CREATE FUNCTION "{{schema}}"."{{table}}_group_took"(p_topic TEXT, p_ids BIGINT[])
RETURNS VOID
LANGUAGE sql SECURITY DEFINER
AS $fn$
    INSERT INTO "{{schema}}"."{{table}}_group_tokens" AS t (topic, grp, tokens, tokens_at)
    SELECT p_topic, x.g,
           least(coalesce(o.burst, d.burst), coalesce(
               (SELECT b.tokens + coalesce(o.rate, d.rate) * extract(epoch FROM
                        greatest(pg_catalog.clock_timestamp(), b.tokens_at) - b.tokens_at)::float8
                FROM "{{schema}}"."{{table}}_group_tokens" b
                WHERE b.topic = p_topic AND b.grp = x.g), coalesce(o.burst, d.burst))) - x.n,
           pg_catalog.clock_timestamp()
    FROM (SELECT coalesce(e.grp, '') COLLATE "C" AS g, count(*) AS n
          FROM "{{schema}}"."{{table}}" e WHERE e.id = ANY (p_ids) AND e.grp IS NOT NULL
          GROUP BY 1) AS x
    LEFT JOIN "{{schema}}"."{{table}}_group_limits" o ON o.topic = p_topic AND o.grp = x.g
    LEFT JOIN "{{schema}}"."{{table}}_group_limits" d ON d.topic = p_topic AND d.grp = ''
    WHERE coalesce(o.rate, d.rate) IS NOT NULL
    ON CONFLICT (topic, grp) DO UPDATE SET tokens = excluded.tokens, tokens_at = excluded.tokens_at
$fn$;
CREATE FUNCTION "{{schema}}"."{{table}}_claim_limited_v3"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_wants INT[], p_max_bytes BIGINT,
    p_claimed BIGINT[], p_cursor TEXT DEFAULT NULL, p_groups INT DEFAULT 32)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               held TEXT, retry_in FLOAT8, bytes BIGINT, grp TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    w RECORD;
    c "{{schema}}"."{{table}}_flow"%ROWTYPE;
    v_topics TEXT[];  -- p_topics, p_wants in the order given, and what holds each back
    v_wants INT[];
    v_whys TEXT[];
    v_waits FLOAT8[];
    allowed INT;
    v_running INT;
    v_tokens FLOAT8;
    v_clock TIMESTAMPTZ;
    ids BIGINT[];
    cand BIGINT[];  -- the rows to try, in turn by group
    got INT;
    locked INT;  -- rows of the topic locked, before the byte cap
    got_bytes BIGINT;
    used BIGINT;  -- stored payload bytes claimed so far, every topic
    why TEXT;
    wait FLOAT8;
    g_capped BOOLEAN;  -- a group of a grouped topic was at its max_running
    g_wait FLOAT8;  -- seconds until a group out of tokens has one
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(
        pg_catalog.hashtextextended('aiooutbox-flow:{{schema}}.{{table}}', 0));
    IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_flow" f WHERE f.topic = '' AND f.paused) THEN
        RETURN QUERY SELECT NULL::bigint, u.t, NULL::text, NULL::text, NULL::text,
            NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
            NULL::text, NULL::boolean, 'paused'::text, NULL::float8, NULL::bigint, NULL::text
            FROM unnest(p_topics) AS u(t);
        RETURN;
    END IF;
    -- What can give nothing now, for every topic at once and without a lock: paused, at
    -- its max_running (its claimed rows counted through the index that holds only
    -- them), out of tokens. A slot or a token freed meanwhile is found at the next ask,
    -- as if this call had come a moment sooner. The other topics are locked, and checked
    -- again under their lock, before any row is claimed.
    SELECT array_agg(s.t ORDER BY s.i), array_agg(s.n ORDER BY s.i),
           array_agg(s.why ORDER BY s.i), array_agg(s.wait ORDER BY s.i)
    INTO v_topics, v_wants, v_whys, v_waits
    FROM (SELECT u.t, u.n, u.i,
                 CASE WHEN f.paused THEN 'paused'
                      WHEN f.max_running IS NOT NULL
                           AND (SELECT count(*) FROM "{{schema}}"."{{table}}" r
                                WHERE r.topic = u.t AND r.flow_counted
                                  AND r.status = 'processing') >= f.max_running
                      THEN 'running'
                      WHEN k.tokens < 1 THEN 'rate' END AS why,
                 (1 - k.tokens) / f.rate AS wait
          FROM unnest(p_topics, p_wants) WITH ORDINALITY AS u(t, n, i)
          LEFT JOIN "{{schema}}"."{{table}}_flow" f ON f.topic = u.t
          CROSS JOIN LATERAL (
              SELECT least(f.burst, f.tokens + f.rate * extract(epoch FROM
                     greatest(pg_catalog.clock_timestamp(), f.tokens_at) - f.tokens_at)::float8)
                     AS tokens) AS k) AS s;
    RETURN QUERY SELECT NULL::bigint, x.t, NULL::text, NULL::text, NULL::text,
        NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
        NULL::text, NULL::boolean, x.why, CASE WHEN x.why = 'rate' THEN x.wait END,
        NULL::bigint, NULL::text
        FROM unnest(v_topics, v_whys, v_waits) AS x(t, why, wait) WHERE x.why IS NOT NULL;
    -- the others' control rows, in name order, so that claimers of the same topics wait
    -- for each other in one order (no deadlock) whatever order they serve them in
    PERFORM 1 FROM "{{schema}}"."{{table}}_flow" f
    WHERE f.topic = ANY (ARRAY(SELECT x.t FROM unnest(v_topics, v_whys) AS x(t, why)
                               WHERE x.why IS NULL))
    ORDER BY f.topic FOR UPDATE;
    -- rows the same claim took before this call (of open topics) count against the cap
    used := 0;
    IF cardinality(p_claimed) > 0 THEN
        used := coalesce((SELECT sum(pg_catalog.pg_column_size(e.payload))
                          FROM "{{schema}}"."{{table}}" AS e WHERE e.id = ANY (p_claimed)), 0);
    END IF;
    -- served in the order given (the consumer's turns: the first gets the cap's first row)
    FOR w IN SELECT x.t, x.n FROM unnest(v_topics, v_wants, v_whys) WITH ORDINALITY
                 AS x(t, n, why, i)
             WHERE x.why IS NULL ORDER BY x.i LOOP
        IF used >= p_max_bytes THEN
            EXIT;  -- the claim is full: the topics after this one get nothing, not even a status
        END IF;
        why := NULL;
        wait := NULL;
        got := 0;
        locked := 0;
        v_running := 0;
        v_tokens := NULL;
        v_clock := NULL;
        SELECT * INTO c FROM "{{schema}}"."{{table}}_flow" f WHERE f.topic = w.t FOR UPDATE;
        allowed := greatest(w.n, 0);
        g_capped := false;
        g_wait := NULL;
        IF NOT FOUND OR NOT (c.paused OR c.max_running IS NOT NULL OR c.rate IS NOT NULL
                             OR c.grouped) THEN
            why := 'open';
        ELSIF c.paused THEN
            why := 'paused';
            allowed := 0;
        ELSE
            IF c.max_running IS NOT NULL THEN
                -- a statement after the row lock: it sees every claim committed before
                v_running := (SELECT count(*) FROM "{{schema}}"."{{table}}" r
                            WHERE r.topic = w.t AND r.flow_counted AND r.status = 'processing');
                allowed := least(allowed, greatest(c.max_running - v_running, 0));
            END IF;
            IF c.rate IS NOT NULL THEN
                v_clock := greatest(pg_catalog.clock_timestamp(), c.tokens_at);
                v_tokens := least(c.burst,
                                  c.tokens + c.rate * extract(epoch FROM v_clock - c.tokens_at)::float8);
                allowed := least(allowed, floor(v_tokens)::int);
            END IF;
        END IF;
        IF allowed > 0 AND why IS NULL AND c.grouped THEN
            -- a statement after the row lock: each group's running rows as committed
            SELECT g.ids, g.capped, g.rate_wait INTO cand, g_capped, g_wait
            FROM "{{schema}}"."{{table}}_group_cands"(w.t, p_cursor, allowed, p_groups) AS g;
        ELSIF allowed > 0 THEN
            cand := ARRAY(SELECT f.id FROM "{{schema}}"."{{table}}_fair_rows"(
                              w.t, p_cursor, allowed, p_groups, NULL, NULL) AS f
                          ORDER BY f.rank, f.pos LIMIT 2 * allowed);
        END IF;
        IF allowed > 0 THEN
            -- a row is taken while the bytes taken before it, this call's earlier topics
            -- included, are below the cap (rows it left out were only locked: the locks
            -- end with the statement)
            SELECT array_agg(k.id) FILTER (WHERE used + k.before < p_max_bytes),
                   coalesce(sum(k.size) FILTER (WHERE used + k.before < p_max_bytes), 0),
                   count(*)
            INTO ids, got_bytes, locked FROM (
                SELECT s.id, s.size,
                       sum(s.size) OVER (ORDER BY s.ord) - s.size AS before
                FROM (SELECT e.id, u.ord, pg_column_size(e.payload) AS size
                      FROM unnest(cand) WITH ORDINALITY AS u(id, ord)
                      JOIN "{{schema}}"."{{table}}" AS e ON e.id = u.id
                      WHERE e.status IN ('pending', 'retry') AND e.available_at <= now()
                      ORDER BY u.ord LIMIT allowed FOR UPDATE OF e SKIP LOCKED) AS s
            ) AS k;
            got := coalesce(cardinality(ids), 0);
            used := used + got_bytes;
        END IF;
        IF got > 0 THEN
            RETURN QUERY
            UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
                attempts = e.attempts + 1, locked_by = p_worker,
                locked_at = coalesce(v_clock, pg_catalog.clock_timestamp()),
                lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
                holds_key = e.ordering_key IS NOT NULL,
                flow_counted = CASE WHEN (c.max_running IS NOT NULL OR c.grouped) AND why IS NULL
                               THEN true
                               ELSE e.flow_counted END
            WHERE e.id = ANY (ids)
            RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
                e.attempts, e.max_attempts,
                least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
                least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
                coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                    WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                    || ':' || e.id)::uuid)::text,
                e.ordering_key, true, NULL::text, NULL::float8,
                pg_catalog.pg_column_size(e.payload)::bigint, e.grp;
        END IF;
        IF why IS NULL AND c.grouped AND got > 0 THEN
            PERFORM "{{schema}}"."{{table}}_group_took"(w.t, ids);
        END IF;
        IF why IS NULL AND c.rate IS NOT NULL THEN
            v_tokens := v_tokens - got;
            UPDATE "{{schema}}"."{{table}}_flow" AS f SET tokens = v_tokens, tokens_at = v_clock
            WHERE f.topic = w.t;
        END IF;
        -- fewer rows than asked, unless the byte cap cut them (then nothing is held)
        IF why IS NULL AND got < w.n AND got = locked THEN
            IF c.max_running IS NOT NULL AND v_running + got >= c.max_running THEN
                why := 'running';
            ELSIF c.rate IS NOT NULL AND v_tokens < 1 THEN
                why := 'rate';
                wait := (1 - v_tokens) / c.rate;
            ELSIF g_capped THEN
                why := 'running';
            ELSIF g_wait IS NOT NULL THEN
                why := 'rate';
                wait := g_wait;
            ELSE
                why := 'empty';
            END IF;
        END IF;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT NULL::bigint, w.t, NULL::text, NULL::text, NULL::text,
                NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                NULL::text, NULL::boolean, why, wait, NULL::bigint, NULL::text;
        END IF;
    END LOOP;
END
$fn$;

-- Consumers of schemas 16 to 18: the claim above, without the group column.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_claim_limited_v2"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_wants INT[], p_max_bytes BIGINT,
    p_claimed BIGINT[])
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               held TEXT, retry_in FLOAT8, bytes BIGINT)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT c.id, c.topic, c.payload, c.dedupe_key, c.headers, c.attempts, c.max_attempts,
           c.created_at, c.available_at, c.message_id, c.ordering_key, c.is_head, c.held,
           c.retry_in, c.bytes
    FROM "{{schema}}"."{{table}}_claim_limited_v3"(p_worker, p_lease, p_topics, p_wants,
                                                    p_max_bytes, p_claimed) AS c
$fn$;
