-- aiooutbox 0012: the inbox, for services that consume from a broker.
-- compatible-with: 2
--
-- One row per (consumer, message id) a receiving service has processed, written in the
-- same transaction as that service's own writes (`aiooutbox.inbox.record`): a message
-- the broker delivers again finds its row and is skipped. Nothing of the outbox reads
-- this table, so code of every earlier schema keeps working beside it.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_inbox" (
    consumer    text        NOT NULL CHECK (consumer <> '' AND length(consumer) <= 200),
    message_id  text        NOT NULL CHECK (message_id <> '' AND length(message_id) <= 1000),
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
-- retention deletes the oldest rows first, in bounded batches
CREATE INDEX IF NOT EXISTS "{{table}}_inbox_received_idx"
    ON "{{schema}}"."{{table}}_inbox" (received_at);
