"""The one exception type for bad user input (archive, config, checkpoint, CLI)."""


class UserError(Exception):
    """Bad input: the message names the file, utterance, key or rank at fault, and a hint."""
