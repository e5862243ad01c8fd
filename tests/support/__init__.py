"""Test doubles and helpers shared by the tests (never shipped in the wheel)."""
