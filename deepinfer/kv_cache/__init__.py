"""Paged KV cache: specs (what a layer keeps), the block pool, prefix hashing, the manager, and
the connector seam to tiers outside the device (connector.py, store/)."""
