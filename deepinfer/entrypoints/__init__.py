"""HTTP entry points: OpenAI- and Anthropic-compatible routes on the engine client (api_server.py)."""
