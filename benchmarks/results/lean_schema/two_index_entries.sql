-- Not a schema anyone can run: lease recovery, retention and SQL producers' ON CONFLICT
-- all lose their index. It measures what the claim's and settlement's functions cost
-- with an unordered event's index entries cut to the bare loop's: the primary key, and
-- the claimable index at insert.
DROP INDEX "{{schema}}"."{{table}}_dedupe_key_idx";
DROP INDEX "{{schema}}"."{{table}}_finished_idx";
DROP INDEX "{{schema}}"."{{table}}_lease_idx";
