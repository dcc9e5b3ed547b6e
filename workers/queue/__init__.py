"""The queue side: fetching from Redis without loss, redelivery, poison, dedup, intake."""
