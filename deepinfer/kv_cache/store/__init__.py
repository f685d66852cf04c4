"""KV tiers behind the connector seam (kv_cache/connector.py): host.py, host memory
(`kv_offloading_size`). Each tier implements both roles, KVConnectorScheduler and KVConnectorWorker."""
