"""KV tiers behind the connector seam (kv_cache/connector.py): host.py, host memory
(`kv_offloading_size`); persistent.py, a persistent store shared between instances (`kv_store`):
a directory (dir.py) or Redis (redis.py), entries in entry.py's format, backend.py the backends'
interface. Each tier implements both roles, KVConnectorScheduler and KVConnectorWorker."""
