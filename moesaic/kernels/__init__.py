"""Optional compiled kernels (built lazily on first use; the plain-torch paths stay the reference).

`codecs` holds the bit-level tables of the packed formats; `cpu` the compiled CPU decode kernels; `env` the
environment switches their dispatch reads at every call.
Nothing here imports another moesaic package: weights/quant.py imports these, never the reverse."""
