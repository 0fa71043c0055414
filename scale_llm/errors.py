"""The one exception type for mistakes a user can fix (config, paths, data, resume mismatch).

The CLI prints its message as one paragraph and exits with code 2, without a traceback. Internal
errors are left alone, so their tracebacks still reach whoever has to fix the code.
"""


class UserError(Exception):
    """A problem in the user's input; the message names the key or file and the fix."""

    exit_code = 2


def short(value: object, limit: int = 80) -> str:
    """repr(value) for a message, cut to `limit` characters: a config value can be huge."""
    text = repr(value) if len(str(value)) < 10 * limit else repr(str(value)[: 2 * limit])
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(str(value)):,} chars)"


def require(command: str, *modules: str) -> None:
    """A UserError saying how to install the Hugging Face extras when one is missing."""
    import importlib.util

    if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
        raise UserError(
            f"{command} needs {'/'.join(modules)} (missing: {', '.join(missing)}): "
            f"{install_hint('hf')}"
        )


def install_hint(extra: str | None = None, packages: tuple[str, ...] = ()) -> str:
    """The command that installs setup.py's optional `extra` (hf, wandb), or `packages`, into
    this Python: in a checkout its editable install with that extra (`.venv/bin/pip install -e
    '.[hf]'), elsewhere the extra's requirements as the installed package's metadata lists them."""
    import importlib.metadata
    import os
    import shlex
    import sys
    from pathlib import Path

    def shown(path: Path) -> str:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else str(path)

    pip_beside = Path(sys.executable).parent / "pip"
    pip = shown(pip_beside) if pip_beside.is_file() else f"{sys.executable} -m pip"
    if extra is None:
        return f"{pip} install {' '.join(packages)}"
    root = Path(__file__).resolve().parents[1]
    if (root / "setup.py").is_file():  # a checkout (an installed wheel has no setup.py)
        where = shown(root)
        return f"{pip} install -e {shlex.quote(f'{where}[{extra}]')}"
    try:
        wanted = [
            r.split(";")[0].strip()
            for r in importlib.metadata.requires("scale_llm") or []
            if f'extra == "{extra}"' in r
        ]
    except importlib.metadata.PackageNotFoundError:
        wanted = []
    return f"{pip} install {' '.join(map(shlex.quote, wanted or packages))}"
