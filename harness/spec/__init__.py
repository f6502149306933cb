"""The spec model: a job spec and a host inventory read from YAML into validated models, every error located."""
