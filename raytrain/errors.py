"""The one exception type that reaches users as a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input (config, data, storage, cluster). The message says what is wrong and what to do.

    The CLI prints it as one line and exits with status 2; no traceback, nothing half-written.
    """
