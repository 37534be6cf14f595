"""Precision held per window: the float16 loss scale, FP8 metadata."""
