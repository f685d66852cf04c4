"""OpenAI-compatible routes: chat completions, responses (chat.py) and completions."""
