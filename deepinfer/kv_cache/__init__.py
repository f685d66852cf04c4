"""Paged KV cache: specs (what a layer keeps), the block pool, prefix hashing, the manager."""
