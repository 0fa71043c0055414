"""The one exception type for mistakes a user can fix (config, paths, data, resume mismatch).

The CLI prints its message as one paragraph and exits with code 2, without a traceback. Internal
errors are left alone, so their tracebacks still reach whoever has to fix the code.
"""


class UserError(Exception):
    """A problem in the user's input; the message names the key or file and the fix."""

    exit_code = 2
