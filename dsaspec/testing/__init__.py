"""Helpers that tests and scripts share (scripts import only ``dsaspec``, never ``tests``).

Imports nothing above ``dsaspec.ops``.
"""
