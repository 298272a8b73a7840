"""Jinja2 templates (``*.cu.j2``) from which sparsecc renders its CUDA/CUTLASS kernels."""
