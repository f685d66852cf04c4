"""The server's side of the engine: an async client of the engine core process."""
