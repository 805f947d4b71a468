"""Persistence: database engine and models, queries, curation, upload ingest, blob stores."""
