"""Signed webhooks fed from a transactional outbox (docs/webhooks.md)."""
