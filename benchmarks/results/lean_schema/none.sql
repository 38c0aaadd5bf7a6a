-- the shipped schema, unchanged (the baseline of the lean-schema runs)
SELECT 1;
