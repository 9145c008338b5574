"""Tinker's `tinker.types.tensor_data` module path; the record itself is hanzo-gym's own (`records.TensorData`)."""

from hanzo_gym.records import TensorData

__all__ = ["TensorData"]
