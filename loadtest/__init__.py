"""Conf-KV package."""
