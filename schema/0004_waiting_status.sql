-- aiooutbox 0004: the 'waiting' status of ordered events that are not the head of their key.
-- compatible-with: 2
--
-- Its own migration: a value added to an enum cannot be used in the transaction that
-- added it (0005 indexes on it). Consumers of schema 2 and 3 never see waiting rows.
ALTER TYPE "{{schema}}"."{{table}}_status" ADD VALUE IF NOT EXISTS 'waiting';
