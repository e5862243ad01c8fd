"""Integration tests: real servers and topologies started on loopback."""
