"""The relay scenario's measurements, one module per group of brokers over a shared kit:
`bare` (the messages, the relay's drain, the alternated rounds against bare client
loops), `nats_rabbitmq` (JetStream, RabbitMQ, all topics, latency) and `streams` (Kafka
and Redis Streams, read-back on and off)."""
