"""Snapshot format v1: manifest + 4 KiB-aligned chunked data, atomic writer, verified restore, tiers, catalog."""
