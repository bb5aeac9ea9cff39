"""Averaging parameters rather than gradients: periodic and hierarchical averagers, the outer
optimizer of DiLoCo and streaming DiLoCo, and the post-local SGD optimizer."""
