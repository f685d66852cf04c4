"""The `deepinfer` command: generate | chat | bench."""
