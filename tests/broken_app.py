"""An application module that fails at import time, for the command line's error test."""

SETTINGS: dict[str, str] = {}
DATABASE_URL = SETTINGS["DATABASE_URL"]
