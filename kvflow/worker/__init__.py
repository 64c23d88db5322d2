"""Pipeline-stage worker processes (one process = a contiguous layer range with a role)."""
