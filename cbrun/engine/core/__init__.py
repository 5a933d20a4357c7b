"""The engine's core: scheduling, requests and their life cycle, the KV-cache manager and its pool."""
