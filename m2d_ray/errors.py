"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class M2DError(Exception):
    """Bad input that the user can fix; the message says how."""
