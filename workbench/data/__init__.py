"""Seeded task generators and loaders of data that ships with installed packages (no downloads)."""
