-- Any language can produce: an event is one INSERT into the outbox table (the seed's),
-- run in the same transaction as the business write it announces.
--
--   psql "$AIOOUTBOX_DSN" -f examples/producer.sql
--
-- The dedupe key makes a repeated insert a no-op, so producers can retry freely. Consumers
-- waiting on LISTEN/NOTIFY wake up at commit (a statement trigger on the table does it).
-- Optional columns: headers (JSONB), max_attempts (default 5), available_at (default now()
-- to run at once; later to delay the event).
--
-- In an application, wrap it with the write it announces:
--   BEGIN;
--   INSERT INTO orders (id, ...) VALUES (42, ...);
--   INSERT INTO outbox_events ... ;   -- this statement
--   COMMIT;

INSERT INTO outbox_events (dedupe_key, topic, payload)
VALUES ('order-42-created', 'orders.created', '{"order_id": 42, "email": "ada@example.com"}')
ON CONFLICT (dedupe_key) DO NOTHING;
