"""What runs generated kernels: the nvcc build and its cache, kernel directories, loading, the
custom ops and their launch path, and timing on the device."""
