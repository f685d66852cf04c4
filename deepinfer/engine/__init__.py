"""The engine core: requests, the scheduler, the typed plan/result boundary, the busy loop."""
