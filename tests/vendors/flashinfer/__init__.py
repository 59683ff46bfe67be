"""Fake flashinfer-python 0.6.14: the package root."""
__version__ = "0.6.14"
