-- aiooutbox 0007: the consumer's hot functions always run their generic plans.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- PL/pgSQL caches each statement's plan, but a statement with parameters is planned
-- afresh for its first five calls, and again on every call for as long as the custom
-- plans look cheaper than the generic one. The claim's first statement (sort, window
-- and row locks over the topic index) stayed on custom plans: re-planned on every
-- claim, about a third of a one-row claim's time (measured ~0.85 -> ~0.55 ms per claim on
-- one connection, docs/benchmarks.md). The generic plans are the ones the plan tests
-- check (`aiooutbox._plans.hot_path_plans` forces them), and the functions' own
-- `enable_seqscan = off` keeps them on their indexes whatever the statistics say.
-- Only configuration changes here: the functions' bodies and signatures stay.

ALTER FUNCTION "{{schema}}"."{{table}}_claim_v6"(
    TEXT, FLOAT8, TEXT[], INT, BIGINT, INT, INT, TIMESTAMPTZ, BIGINT)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION "{{schema}}"."{{table}}_settle_done_v5"(BIGINT[], TEXT, INT)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION "{{schema}}"."{{table}}_settle_failed_v5"(
    BIGINT[], FLOAT8[], TEXT[], TEXT[], TEXT, INT)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION "{{schema}}"."{{table}}_promote"(TEXT[])
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION "{{schema}}"."{{table}}_requeue_v5"(TEXT, BIGINT[], INT, TEXT)
    SET plan_cache_mode = force_generic_plan;
