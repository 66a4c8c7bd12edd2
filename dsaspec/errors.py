"""The exception type for mistakes in what the user gave: an option, an environment variable, a file.

The ``dsaspec`` command prints a :class:`UserError` as one line, ``dsaspec: error: <message>``, and
exits with status 2. Every other exception is a bug and keeps its traceback, so raise this only
for input the user can fix, with a message that names the option, variable or file.
"""


class UserError(ValueError):
    """Bad user input (an option, an environment variable, a file); the message names it."""
