"""The errors the library raises for its callers to handle."""


class InputError(ValueError):
    """Bad user input; the message starts with the flag (or argument) at fault."""


class NonFiniteLogitsError(RuntimeError):
    pass
