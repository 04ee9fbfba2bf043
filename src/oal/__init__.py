"""oal: Outlier-Aware Attention Linearization (grouped positive quadratic kernels, linear in sequence length)."""

__version__ = "0.1.0"
