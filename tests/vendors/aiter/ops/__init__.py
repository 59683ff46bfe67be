"""Fake aiter.ops (a package of the fake aiter)."""
