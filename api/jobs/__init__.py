"""Comparison jobs: claimed by workers from the database queue."""
