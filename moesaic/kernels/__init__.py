"""Optional compiled kernels (built lazily on first use; the plain-torch paths stay the reference)."""
