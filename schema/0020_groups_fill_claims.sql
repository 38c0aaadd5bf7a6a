-- aiooutbox 0020: a claim over many groups fills itself, so its cost per event does not
-- grow with the number of groups.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of every earlier schema keep working: `fair_rows` keeps its signature and
-- results, and every claim that reads groups in turn calls it (`claim_v6`, `claim_v7`,
-- `claim_v8`, `claim_limited_v2`, `claim_limited_v3` through `group_cands`). A later
-- migration that replaces `fair_rows` starts from the body below.
--
-- Why: 0018's `fair_rows` visited at most `p_groups` groups (the consumer's 128) per
-- claim. With many groups of a few due events each (10,000 groups, 5 events each) a
-- claim of 1,500 then found at most 640 rows, so a drain made 2.5 times as many claims
-- (each with its fixed costs: the lock step, the update's set-up, the round trip, the
-- settlement batch that follows) as the same drain in one group, and ran at 0.6-0.7x.
--
-- Now `p_groups` is the size of a *batch* of groups: the claim visits the groups in the
-- same turn order as before (after the consumer's cursor, in name order; then, wrapping
-- around, the ungrouped rows and the groups up to the cursor), a batch at a time, and
-- goes on to the next batch while the rows found are fewer than the claim's size,
-- never visiting more groups than that size (each group it visits has a row to give).
-- A batch's groups give their oldest due rows, up to a share of twice what is still
-- needed; every visited group's rows are ranked in it, so the claim still takes every
-- group's first row, then every group's second, and so on: a claim serves at least
-- `p_groups` groups with work (or all of them), more when they have few rows each.
-- The next batch's size is what the groups visited so far gave per group, applied to
-- the rows still needed (at least `p_groups`, at most twice the batch before). Each visited group costs one index
-- descent to find it and one to read its rows, as before: a claim's cost follows the
-- rows it takes, not the number of groups that exist.

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_fair_rows"(
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
    step INT := greatest(least(p_groups, p_limit), 1);  -- the first batch's visits
    most INT := greatest(p_limit, 1);  -- visits at most: each visited group has a row
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
    -- the turn order as segments: 'u' the ungrouped rows' turn, 'a' the groups after
    -- `low`, 'w' (wrapped around) the groups after '' up to the cursor
    segs TEXT[] := CASE WHEN p_cursor IS NULL THEN ARRAY['u', 'a']
                        WHEN p_cursor = '' THEN ARRAY['a', 'u']
                        ELSE ARRAY['a', 'u', 'w'] END;
    seg INT := 1;
    low TEXT := coalesce(p_cursor, '');  -- the groups of segment 'a' come after it
    want INT;
    found TEXT[];
    kept TEXT[];
    visits TEXT[];  -- this batch's visits (NULL: the ungrouped rows' turn)
    visited INT := 0;  -- visits of the batches before
    got INT := 0;  -- rows they gave
    n INT;
    per INT;
BEGIN
    IF segs[1] = 'u' THEN
        low := '';  -- after the ungrouped rows, every group in order
    END IF;
    LOOP
        -- the next batch: up to `want` visits in turn
        want := CASE WHEN visited = 0 THEN step
                     ELSE greatest(step, ceil((p_limit - got)::numeric * visited
                                              / greatest(got, 1))::int) END;
        -- at most twice the last batch: groups with no due rows (all scheduled later)
        -- do not send a claim through every group at once
        want := least(want, most - visited, 2 * greatest(cardinality(visits), step));
        visits := '{}';
        WHILE cardinality(visits) < want AND seg <= cardinality(segs) LOOP
            IF segs[seg] = 'u' THEN
                visits := array_append(visits, NULL::text);
                seg := seg + 1;
                CONTINUE;
            END IF;
            n := want - cardinality(visits);
            found := "{{schema}}"."{{table}}_groups_after"(p_topic, low, n);
            IF segs[seg] = 'w' THEN  -- up to the cursor (served last, so visited last)
                kept := ARRAY(SELECT f.g FROM unnest(found) AS f(g)
                              WHERE f.g <= p_cursor COLLATE "C");
            ELSE
                kept := found;
            END IF;
            visits := visits || kept;
            IF cardinality(kept) < n THEN
                seg := seg + 1;  -- this segment has no more groups
                low := '';  -- the wrapped-around segment starts at the first group
            ELSE
                low := kept[cardinality(kept)];
            END IF;
        END LOOP;
        EXIT WHEN cardinality(visits) = 0;
        per := CASE WHEN visited = 0 AND cardinality(visits) = 1 THEN p_limit
                    ELSE least(p_limit, greatest(1, ceil(2.0 * (p_limit - got)
                                                         / cardinality(visits))::int)) END;
        RETURN QUERY
        SELECT x.id, x.rank, visited + v.pos, coalesce(v.g, '')
        FROM unnest(visits) WITH ORDINALITY AS v(g, pos)
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
        GET DIAGNOSTICS n = ROW_COUNT;
        got := got + n;
        visited := visited + cardinality(visits);
        EXIT WHEN got >= p_limit OR visited >= most OR seg > cardinality(segs);
    END LOOP;
END
$fn$;

-- The claim from low marks, its probe bounded (`claim_v8`, 0019, with four more
-- arguments). `claim_v8`'s probe finds a topic's first claimable row by descending into
-- every named group of it: with 10,000 groups that is 20,000 index descents (0.16-0.26 s,
-- 80,000 buffers, measured), however few rows the claim takes. `claim_v9` probes at most
-- `p_probe_groups` groups of each topic per call, after where its previous call stopped
-- (`p_probe_after`, the topic's *sweep*), and keeps the lowest position it found in the
-- sweep (`p_probe_us`, `p_probe_id`: a mark candidate, as epoch microseconds and id).
-- The topic's mark moves only when a sweep has visited every group: to the lowest of
-- the sweep's candidates. Each call adds to them its ungrouped range's first row, the
-- first row of each group it probes, and its bound (10 ms before the oldest position
-- key held and before its reading); a key awaited that left takes them back as it takes
-- the mark. So the new mark passes no claimable row: a row a probe of its group saw is
-- at or after that group's candidate, and a row made claimable since (committed after
-- that probe's snapshot, or placed again by a retry or a recovery) has a position after
-- that probe's bound. Until the sweep ends the mark stays where it was (claims start
-- there, lower than they could: they walk the dead entries of the rows claimed since,
-- as the claims between two readings of the marks do). A topic without named groups
-- ends its sweep at every call, as `claim_v8` does.
--
-- The arguments after `claim_v8`'s: p_probe_after, the group each topic's sweep probed
-- last (NULL: a sweep starts at the first group); p_probe_us, p_probe_id, the sweep's
-- lowest candidate so far (NULL microseconds: -infinity; ignored when a sweep starts);
-- p_probe_groups, the most groups
-- probed per topic per call. The last row's payload adds "after", "low_us" and "low_id",
-- each topic's sweep as the next call takes it (NULL "after": a sweep ended, the next
-- starts anew).
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v9"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_mark_us BIGINT[], p_mark_id BIGINT[], p_awaited BIGINT[],
    p_grace FLOAT8, p_cursor TEXT, p_groups INT, p_probe_after TEXT[], p_probe_us BIGINT[],
    p_probe_id BIGINT[], p_probe_groups INT)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               grp TEXT, redelivered BOOLEAN)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    read_at TIMESTAMPTZ := clock_timestamp();
    read_ms BIGINT;
    open_keys BIGINT[];
    awaited BIGINT[];
    back_to TIMESTAMPTZ;
    bound TIMESTAMPTZ;
    after_at TIMESTAMPTZ;
    after_id BIGINT;
    probe_n INT := greatest(coalesce(p_probe_groups, 1), 1);
    i INT;
    m_at TIMESTAMPTZ;  -- topic i's mark (taken back to an awaited key that left)
    m_id BIGINT;
    low_at TIMESTAMPTZ;  -- its sweep's lowest candidate (NULL: none yet)
    low_id BIGINT;
    f_at TIMESTAMPTZ;
    f_id BIGINT;
    grps TEXT[];  -- the groups probed (and one more, if any), their first rows
    ats TIMESTAMPTZ[];
    fids BIGINT[];
    new_us BIGINT[] := '{}';
    new_id BIGINT[] := '{}';
    new_after TEXT[] := '{}';
    new_low_us BIGINT[] := '{}';
    new_low_id BIGINT[] := '{}';
BEGIN
    -- pg_locks first: every statement below takes its snapshot after this reading
    read_ms := floor(date_part('epoch', read_at) * 1000)::bigint;
    open_keys := "{{schema}}"."{{table}}_open_positions"();
    -- held longer than the grace, or awaited already: awaited
    awaited := ARRAY(SELECT k FROM unnest(open_keys) AS u(k)
                     WHERE k = ANY (coalesce(p_awaited, '{}')) OR read_ms - k > p_grace * 1000
                     ORDER BY k);
    -- an awaited key that left: its rows are visible now; the marks go back to it
    -- (10 ms before it, as below)
    SELECT to_timestamp(min(a) / 1000.0) - interval '10 ms' INTO back_to
    FROM unnest(coalesce(p_awaited, '{}')) AS u(a) WHERE NOT (a = ANY (open_keys));
    -- 10 ms before the oldest key held and before this reading (as `claim_v8`)
    SELECT least(read_at, to_timestamp(min(k) / 1000.0)) - interval '10 ms' INTO bound
    FROM unnest(open_keys) AS u(k) WHERE NOT (k = ANY (awaited));
    -- where this claim starts: the lowest of its topics' marks
    SELECT s.at, s.id INTO after_at, after_id FROM (
        SELECT CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m.at, m.id)
                    THEN back_to ELSE m.at END AS at,
               CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m.at, m.id)
                    THEN 0 ELSE m.id END AS id
        FROM (SELECT CASE WHEN x.us IS NULL THEN '-infinity'::timestamptz
                          ELSE 'epoch'::timestamptz + x.us * interval '1 microsecond' END AS at,
                     coalesce(x.mid, 0) AS id
              FROM unnest(p_topics, p_mark_us, p_mark_id) AS x(t, us, mid)) AS m) AS s
    ORDER BY s.at, s.id LIMIT 1;
    RETURN QUERY
    SELECT c.id, c.topic, c.payload, c.dedupe_key, c.headers, c.attempts, c.max_attempts,
           c.created_at, c.available_at, c.message_id, c.ordering_key, c.is_head, c.grp,
           CASE WHEN c.attempts > 1 THEN true WHEN c.ordering_key IS NULL THEN false
                ELSE coalesce((SELECT e.last_error IS NOT NULL FROM "{{schema}}"."{{table}}" AS e
                               WHERE e.id = c.id), false) END
    FROM "{{schema}}"."{{table}}_claim_v7"(p_worker, p_lease, p_topics, p_limit, p_max_bytes,
                                           p_run, p_run_rows, after_at, after_id, p_cursor,
                                           p_groups) AS c;
    -- each topic's probe (not locking: rows other claims hold locked count)
    FOR i IN 1 .. coalesce(cardinality(p_topics), 0) LOOP
        m_at := CASE WHEN p_mark_us[i] IS NULL THEN '-infinity'::timestamptz
                     ELSE 'epoch'::timestamptz + p_mark_us[i] * interval '1 microsecond' END;
        m_id := coalesce(p_mark_id[i], 0);
        IF back_to IS NOT NULL AND (back_to, 0::bigint) < (m_at, m_id) THEN
            m_at := back_to;
            m_id := 0;
        END IF;
        low_at := NULL;
        low_id := NULL;
        IF p_probe_after[i] IS NOT NULL THEN  -- a sweep goes on (NULL microseconds: -infinity)
            low_at := CASE WHEN p_probe_us[i] IS NULL THEN '-infinity'::timestamptz
                           ELSE 'epoch'::timestamptz + p_probe_us[i] * interval '1 microsecond' END;
            low_id := coalesce(p_probe_id[i], 0);
            -- an awaited key that left: the groups probed before did not see its rows
            IF back_to IS NOT NULL AND (back_to, 0::bigint) < (low_at, low_id) THEN
                low_at := back_to;
                low_id := 0;
            END IF;
        END IF;
        -- this call's bound
        IF low_at IS NULL OR (bound, 0::bigint) < (low_at, low_id) THEN
            low_at := bound;
            low_id := 0;
        END IF;
        -- the ungrouped range's first row after the mark
        SELECT c.available_at, c.id INTO f_at, f_id FROM "{{schema}}"."{{table}}" AS c
        WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
          AND coalesce(c.grp, '') = '' AND (c.available_at, c.id) > (m_at, m_id)
        ORDER BY c.available_at, c.id LIMIT 1;
        IF FOUND AND (f_at, f_id - 1) < (low_at, low_id) THEN
            low_at := f_at;
            low_id := f_id - 1;
        END IF;
        -- up to probe_n + 1 groups after the sweep's last, each with its first row after
        -- the mark: a skip scan that looks only at entries after the mark (in the index),
        -- one descent per group (the index orders a group's rows by position)
        SELECT coalesce(array_agg(g.grp ORDER BY g.n), '{}'),
               coalesce(array_agg(g.at ORDER BY g.n), '{}'),
               coalesce(array_agg(g.id ORDER BY g.n), '{}')
        INTO grps, ats, fids
        FROM (WITH RECURSIVE g(grp, at, id, n) AS (
                  (SELECT coalesce(c.grp, ''), c.available_at, c.id, 1
                   FROM "{{schema}}"."{{table}}" AS c
                   WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
                     AND coalesce(c.grp, '') > coalesce(p_probe_after[i], '')
                     AND (c.available_at, c.id) > (m_at, m_id)
                   ORDER BY coalesce(c.grp, ''), c.available_at, c.id LIMIT 1)
                  UNION ALL
                  SELECT s.grp, s.at, s.id, g.n + 1 FROM g CROSS JOIN LATERAL (
                      SELECT coalesce(c.grp, '') AS grp, c.available_at AS at, c.id
                      FROM "{{schema}}"."{{table}}" AS c
                      WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
                        AND coalesce(c.grp, '') > g.grp
                        AND (c.available_at, c.id) > (m_at, m_id)
                      ORDER BY coalesce(c.grp, ''), c.available_at, c.id LIMIT 1) AS s
                  WHERE g.n <= probe_n)
              SELECT * FROM g) AS g;
        SELECT u.at, u.id INTO f_at, f_id
        FROM unnest(ats[1:probe_n], fids[1:probe_n]) AS u(at, id)
        ORDER BY u.at, u.id LIMIT 1;
        IF FOUND AND (f_at, f_id - 1) < (low_at, low_id) THEN
            low_at := f_at;
            low_id := f_id - 1;
        END IF;
        IF cardinality(grps) <= probe_n THEN
            -- the sweep has seen every group: the new mark, and a sweep starts anew
            new_us := new_us || CASE WHEN low_at = '-infinity' THEN NULL
                                     ELSE "{{schema}}"."{{table}}_epoch_us"(low_at) END;
            new_id := new_id || low_id;
            new_after := new_after || NULL::text;
            new_low_us := new_low_us || NULL::bigint;
            new_low_id := new_low_id || NULL::bigint;
        ELSE
            -- groups left: the mark stays, the sweep goes on after the last probed
            new_us := new_us || CASE WHEN m_at = '-infinity' THEN NULL
                                     ELSE "{{schema}}"."{{table}}_epoch_us"(m_at) END;
            new_id := new_id || m_id;
            new_after := new_after || grps[probe_n];
            new_low_us := new_low_us || CASE WHEN low_at = '-infinity' THEN NULL
                                             ELSE "{{schema}}"."{{table}}_epoch_us"(low_at) END;
            new_low_id := new_low_id || low_id;
        END IF;
    END LOOP;
    RETURN QUERY SELECT NULL::bigint, NULL::text,
                        json_build_object('us', to_json(new_us), 'id', to_json(new_id),
                                          'awaited', to_json(awaited),
                                          'after', to_json(new_after),
                                          'low_us', to_json(new_low_us),
                                          'low_id', to_json(new_low_id))::text,
                        NULL::text, NULL::text, NULL::int,
                        NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                        NULL::text, NULL::boolean, NULL::text, NULL::boolean;
END
$fn$;
