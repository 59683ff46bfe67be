"""Fake aiter.utility (a package of the fake aiter)."""
