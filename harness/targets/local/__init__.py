"""Simulated nodes on this machine."""
