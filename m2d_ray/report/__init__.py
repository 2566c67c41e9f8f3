"""Tables and figures built from a run directory's records."""
