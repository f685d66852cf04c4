"""Tool calling: which tools a turn offers, schema checks, and the output constraint for forced calls."""
