"""The one exception type for mistakes a user can fix (config, paths, data, resume mismatch).

The CLI prints its message as one paragraph and exits with code 2, without a traceback. Internal
errors are left alone, so their tracebacks still reach whoever has to fix the code.
"""


class UserError(Exception):
    """A problem in the user's input; the message names the key or file and the fix."""

    exit_code = 2


INSTALL = "pip install 'scale_llm[hf]'"  # the Hugging Face extras


def require(command: str, *modules: str) -> None:
    """A UserError saying how to install the Hugging Face extras when one is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"{command} needs {'/'.join(modules)} (missing: {', '.join(missing)}): {INSTALL}"
        )


def require_writable_dir(path, key: str) -> None:
    """Before any work: `path` (the value of config key `key`) is, or can become, a writable
    directory. Names the first existing part of the path that is a file or read-only."""
    import os
    from pathlib import Path

    p = Path(path).absolute()
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"{key}={path}: {existing} is a file, not a directory; point {key} at a directory "
            f"(or move the file away)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{key}={path}: {existing} is not writable by this user; point {key} at a "
            f"directory you can write to"
        )
