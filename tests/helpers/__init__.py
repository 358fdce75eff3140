"""Test plumbing shared by several test modules (not tests themselves)."""
