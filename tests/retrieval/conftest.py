"""Fixtures shared with other test folders."""

from tests.indexing.test_store_diskfull import tiny_fs  # noqa: F401 - a 4 MiB tmpfs (skips where mounting fails)
