-- dedupe_key index partial (WHERE dedupe_key IS NOT NULL): breaks SQL producers' ON CONFLICT (dedupe_key)
DROP INDEX "{{schema}}"."{{table}}_dedupe_key_idx";
CREATE UNIQUE INDEX "{{table}}_dedupe_key_idx" ON "{{schema}}"."{{table}}" (dedupe_key)
    WHERE dedupe_key IS NOT NULL;
