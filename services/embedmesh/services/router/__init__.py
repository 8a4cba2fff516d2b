"""The KV-aware router: worker registry, radix indexer over chained block hashes, and cost-based choice."""
