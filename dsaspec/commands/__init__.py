"""The ``dsaspec`` command line: the entry point and ``dsaspec generate``."""
