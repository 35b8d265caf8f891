"""One error type for bad input: the CLI prints its message on one line and exits non-zero, no traceback."""

from __future__ import annotations


class L47Error(Exception):
    """Bad input or a refused operation. Message names the file, the field, what was expected and found."""

    def __init__(self, where: str, field: str, expected: str, found: str):
        self.where, self.field, self.expected, self.found = str(where), field, expected, found
        super().__init__(f"{where}: {field}: expected {expected}, found {found}")
