"""HTTP routes under /api/v1: each parses, authorizes and makes one service call."""
