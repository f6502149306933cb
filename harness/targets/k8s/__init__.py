"""Kubernetes: manifests rendered from the spec (core objects or a JobSet)."""
