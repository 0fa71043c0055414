"""How scale_llm writes to disk: a file appears whole or not at all (temporary name, fsync, rename);
a command removes only what its marker proves it made; one process at a time holds a folder
(`OwnerLock`); a user's folder is read without running its Python or leaving it by a link."""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scale_llm.errors import UserError

log = logging.getLogger(__name__)


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file  # a directory's entries: a rename or a new file in it survives a power cut


def entries_below(root: Path) -> Iterator[Path]:
    """Every entry below `root` (a symlinked folder listed, not entered; one this user may not
    read skipped, as Path.rglob does), walked without recursion: a tree thousands of folders
    deep is no RecursionError."""
    stack = [Path(root)]
    while stack:
        folder = stack.pop()
        try:
            found = os.scandir(folder)
        except PermissionError:
            continue
        with found:
            for entry in found:
                yield folder / entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(folder / entry.name)


def fsync_tree(root: Path | str) -> None:
    """Every regular file below `root`, then every directory (symlinks are not followed)."""
    for path in entries_below(Path(root)):
        if not path.is_symlink() and path.is_file():
            fsync_file(path)
        elif path.is_dir() and not path.is_symlink():
            fsync_dir(path)
    fsync_dir(root)


def stamped_name(parent: Path, stem: str, suffix: str = "") -> Path:
    """parent/<stem>-<UTC time><suffix>, with -2, -3, ... before the suffix while that is taken."""
    first, n = f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}", 1
    while not absent(path := parent / f"{first}{f'-{n}' * (n > 1)}{suffix}"):
        n += 1
    return path


def temporary_sibling(path: Path, tag: str = "tmp") -> Path:
    """A name beside `path` that no other process uses: `.NAME.tag-PID-RANDOM` (NAME cut to
    its first 100 bytes: a name near the file system's 255 bytes still has a sibling)."""
    name = os.fsencode(path.name)[:100].decode("utf-8", "ignore")  # (whole characters)
    return path.parent / f".{name}.{tag}-{os.getpid()}-{os.urandom(3).hex()}"


@contextlib.contextmanager
def made_folder(folder: Path) -> Iterator[None]:
    """`folder` made with its missing parents; those it made are removed again (while empty)
    when the block fails, so that a refused or failed write leaves nothing behind."""
    made = list(itertools.takewhile(absent, [folder, *folder.parents]))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Readers see the old file or the new one; a symlink or special file there is refused."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UserError(
            f"{path} is {describe_kind(path)}, not a regular file; scale_llm writes only regular "
            f"files there: move it away or point the command elsewhere"
        )
    tmp = temporary_sibling(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)  # tmp is this process's own new file; path is a regular file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def new_file_mode() -> int:
    """The mode a new file gets here (0644 under the usual umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def describe_kind(path: Path) -> str:
    """'a symlink', 'a directory', 'a named pipe', ... for messages about a path's type."""
    return next((kind for test, kind in _KINDS if test(path)), "missing")


_KINDS = (
    (Path.is_symlink, "a symlink"),
    (Path.is_dir, "a directory"),
    (Path.is_fifo, "a named pipe"),
    (Path.is_socket, "a socket"),
    (lambda p: p.is_block_device() or p.is_char_device(), "a device"),
    (Path.is_file, "a file"),
)


def require_kind(path: Path, kind: str, what: str) -> None:
    """`path` is missing or `kind` ("a folder" or "a regular file", not through a link): where a
    run keeps `what`, a pipe, a device or a link would block it or send its writes elsewhere."""
    if not (path.exists() or path.is_symlink()) or (
        path.is_dir() if kind == "a folder" else (path.is_file() and not path.is_symlink())
    ):
        return
    found = describe_kind(path)
    if path.is_symlink():
        target = describe_kind(Path(os.path.realpath(path)))
        found = f"a symlink to {'nothing' if target == 'missing' else target}"
    raise UserError(
        f"{path} is {found}, but the run keeps {what} there, as {kind}; move it away (or pick "
        f"another run.name) and launch again"
    )


def unwritable_dir(path: Path | str) -> tuple[Path, str] | None:
    """(the first existing part of `path`, "file" or "read-only") when `path` is not and cannot
    become a writable directory; None when it is or can."""
    existing = Path(path).absolute()
    while absent(existing) and existing != existing.parent:  # (a dangling link is no folder)
        existing = existing.parent
    if not existing.is_dir():
        return existing, "file"
    return None if os.access(existing, os.W_OK | os.X_OK) else (existing, "read-only")


def require_writable_dir(path: Path | str, key: str) -> None:
    """Before any work: `path` (config key `key`) is, or can become, a writable directory."""
    if found := unwritable_dir(path):
        existing, why = found
        what = (
            f"{describe_kind(existing)}, not a directory"
            if why == "file"
            else "not writable by this user"
        )
        fix = "(or move the file away)" if why == "file" else "you can write to"
        raise UserError(f"{key}={path}: {existing} is {what}; point {key} at a directory {fix}")


# Every JSON the project reads goes through `parse_json`, bounded in size and nesting: a hostile
# file gives a UserError, never a MemoryError or RecursionError (ours nest ~6 deep, HF's ~10).
MAX_JSON_DEPTH = 64
MAX_JSON_BYTES = 1 << 30  # 1 GiB: a Hugging Face tokenizer.json is ~10 MB, a manifest ~1 MB


class JSONProblem(ValueError):
    """Why a text is not JSON this project reads (the reason, in words)."""


def parse_json(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The value of a JSON text nested at most `max_depth` deep; JSONProblem otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:  # the decoder recurses per level: ~1,000 levels exhaust the stack
        raise JSONProblem(f"nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError:
        raise JSONProblem("not UTF-8 text") from None
    except ValueError as e:
        raise JSONProblem(f"not JSON: {str(e)[:120]}") from None
    if nested_deeper(value, max_depth):
        raise JSONProblem(f"nested deeper than {max_depth} levels")
    return value


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests dicts, lists or tuples more than `limit` deep, found without
    recursion (a crafted file nests 100,000 deep, where any recursive reader fails)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))
    return False


def read_json(
    path: Path | str, what: str, fix: str, kind: type = dict, max_bytes: int = MAX_JSON_BYTES
) -> Any:
    """The JSON value of the regular file `path`, which must be a `kind`; anything else is a
    UserError naming the file, `what` it is, and `fix`. A symlink is followed (the Hub cache links
    its blobs); a FIFO is never opened."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UserError(f"{path} ({what}) is not a regular file; {fix}")
            if st.st_size > max_bytes:
                raise UserError(
                    f"{path} ({what}) is {st.st_size:,} bytes, more than the {max_bytes:,} such "
                    f"a file can hold; {fix}"
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(max_bytes + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{path} ({what}) cannot be read ({e.strerror}); {fix}") from None
    try:
        value = parse_json(raw)
    except JSONProblem as e:
        raise UserError(f"{path} ({what}) cannot be read as JSON ({e}); {fix}") from None
    if not isinstance(value, kind):
        raise UserError(
            f"{path} ({what}) holds a JSON {_json_kind(value)}, not {_json_kind(kind())}; {fix}"
        )
    return value


def json_values(lines: list[bytes]) -> list[Any]:
    """Each line's JSON value (`parse_json`'s: bounded), None for one that is not UTF-8 JSON."""
    values: list[Any] = []
    for line in lines:
        try:
            values.append(parse_json(line.decode("utf-8")))
        except (UnicodeDecodeError, JSONProblem):
            values.append(None)
    return values


def json_object_or_none(path: Path | str, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """The JSON object in `path`, or None where there is none (missing, unreadable, not one)."""
    try:
        return read_json(path, "", "", max_bytes=max_bytes)
    except UserError:
        return None


def _json_kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


# A folder a user names (data.tokenizer, model.init_from, an export) is copied into what the
# project writes and handed to transformers, so: a symlink in it is followed only to a file inside
# it or inside its Hub cache entry (`models--ORG--NAME`: snapshots/REV/FILE links ../../blobs/SHA);
# a folder whose config names custom code is refused (and trust_remote_code stays False).
HUB_ENTRY_PREFIX = "models--"
CODE_KEYS = ("auto_map", "custom_pipelines")  # where transformers looks for a folder's classes
LINK_FIX = "replace the link by the file itself, or remove it"


def folder_file(folder: Path, name: str, what: str) -> Path | None:
    """The path to open for file `name` of `folder` (itself, or an admitted link's target); None
    when no regular file of that name is there; a UserError for a link out of the folder."""
    path = Path(folder) / name
    if not path.is_symlink():
        return path if path.is_file() else None
    try:
        target = path.resolve()  # every link of a chain followed: judged by where it ends
    except (OSError, RuntimeError):  # a loop
        raise UserError(f"{what}: {path} is a symlink that loops; {LINK_FIX}") from None
    real = Path(folder).resolve()  # a link may lead into the folder or its Hub cache entry
    hub_entry = [p for p in (real, *real.parents) if p.name.startswith(HUB_ENTRY_PREFIX)][:1]
    if not any(target.is_relative_to(root) for root in (real, *hub_entry)):
        raise UserError(
            f"{what}: {path} is a symlink to {target}, outside {folder}; scale_llm copies a "
            f"folder's files into what it writes (data, checkpoints, exports), so it reads "
            f"only files inside the folder (or inside its Hugging Face cache entry, "
            f"{HUB_ENTRY_PREFIX}ORG--NAME): {LINK_FIX}"
        )
    return target if target.is_file() else None


def read_folder_file(folder: Path, name: str, what: str) -> bytes | None:
    """The bytes of file `name` of `folder` (None: no such regular file), opened O_NOFOLLOW."""
    if (path := folder_file(folder, name, what)) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:  # ELOOP: replaced by a link since it was checked
        raise UserError(f"{what}: {Path(folder) / name} cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_JSON_BYTES:
            raise UserError(
                f"{what}: {Path(folder) / name} is not a regular file of at most "
                f"{MAX_JSON_BYTES:,} bytes; give a folder whose files are regular files"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_JSON_BYTES + 1)
    finally:
        os.close(fd)


def custom_code_problem(folder: Path, what: str) -> str | None:
    """Why transformers would run Python from `folder` (None: it would not): a `*config.json`
    holding a CODE_KEYS key, or naming a `.py` file the folder holds."""
    folder = Path(folder)
    modules = {p.stem for p in folder.glob("*.py")}
    for config in sorted(folder.glob("*config.json")):
        if (path := folder_file(folder, config.name, what)) is None:
            continue
        value = read_json(path, f"{what}'s {config.name}", "fix or remove the file", kind=object)
        if found := _code_reference(value, modules):
            key, item, module = found
            said = f"{module}.py, Python in the folder" if module else "custom code"
            shown = json.dumps(item, ensure_ascii=False)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            return (
                f"{config} names {said} ({key}: {shown}); scale_llm never runs Python "
                f"from a model folder (transformers' trust_remote_code stays off): remove "
                f"{key} from {config.name} if transformers' own classes read the model, or "
                f"give a folder without custom code"
            )
    return None


def _code_reference(value: Any, modules: set[str]) -> tuple[str, Any, str | None] | None:
    """(key, value, module or None) of the first entry naming code: a CODE_KEYS key first."""
    items = list(_json_items(value))
    for key, item in items:
        if key.rsplit(".", 1)[-1] in CODE_KEYS:
            return key, item, None
    return next(((k, v, m) for k, v in items if (m := _module_named(v, modules))), None)


def _json_items(value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every entry of a JSON value, iteratively."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        key, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{key}.{k}".lstrip("."), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(item))
        if key:
            yield key, item


def _module_named(item: Any, modules: set[str]) -> str | None:
    """The module a config string names: "mod", "mod.py", "mod.Class" or "repo--mod.Class"."""
    if not isinstance(item, str) or not modules:
        return None
    ref = item.rsplit("--", 1)[-1].removesuffix(".py")
    return head if (head := ref.split(".", 1)[0]) in modules else None


OWNER_MARKER = ".scale-llm-owner.json"  # in a folder a command created and may remove again
MAX_RECORD_BYTES = 4096  # an owner record or marker: {"kind", "pid", "host", "at"}, ~100 bytes


def make_owned_dir(path: Path, kind: str, exists: bool = False) -> Path:
    """Create folder `path` (an existing one is not ours: unless `exists`, a fresh folder this
    process just made) with the marker of `kind` inside, naming this process."""
    if not exists:
        path.mkdir(parents=False, exist_ok=False)
    me = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), "at": time.time()}
    atomic_write_json(path / OWNER_MARKER, me)
    return path


def owner_running(path: Path) -> bool:
    """Whether another process that marked `path` may still run: alive here, or of another host
    (what this process marked earlier belongs to work it has finished)."""
    marker = json_object_or_none(path / OWNER_MARKER, MAX_RECORD_BYTES) or {}
    pid, host = marker.get("pid"), marker.get("host")
    if host is not None and host != socket.gethostname():
        return True
    return isinstance(pid, int) and not isinstance(pid, bool) and pid != os.getpid() and _alive(pid)


def owned_kind(path: Path) -> str | None:
    """The kind `make_owned_dir` recorded in `path`, or None (not ours, damaged, a symlink)."""
    marker = path / OWNER_MARKER
    if path.is_symlink() or not path.is_dir() or marker.is_symlink() or not marker.is_file():
        return None
    kind = (json_object_or_none(marker, MAX_RECORD_BYTES) or {}).get("kind")
    return kind if isinstance(kind, str) else None  # (unreadable, damaged, too large: not ours)


def remove_owned_dir(path: Path, kind: str) -> None:
    """Remove folder `path` if `make_owned_dir(path, kind)` made it; refuse otherwise."""
    if not path.exists() and not path.is_symlink():
        return
    if owned_kind(path) != kind:
        raise UserError(
            f"{path} was not created by scale_llm as a {kind} folder (it has no {OWNER_MARKER} "
            f"of that kind), so it is left alone; remove it yourself or pick another path"
        )
    shutil.rmtree(path)


_TEMPORARY: list[Path] = []


def temporary_folder(prefix: str) -> Path:
    """A private folder in the system's temporary folder, removed as this process ends: at exit,
    or by `remove_temporary_folders` where a process skips the interpreter's exit (a process
    of a gloo world ends with os._exit)."""
    path = Path(os.path.realpath(tempfile.mkdtemp(prefix=prefix)))
    _TEMPORARY.append(path)
    atexit.unregister(remove_temporary_folders)  # (registered once)
    atexit.register(remove_temporary_folders)
    return path


def remove_temporary_folders() -> None:
    while _TEMPORARY:
        shutil.rmtree(_TEMPORARY.pop(), ignore_errors=True)


@contextlib.contextmanager
def private_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder inside `parent` for this block only, removed at the end; `parent` is
    created if missing and removed again if this block made it and left it empty."""
    created = list(itertools.takewhile(absent, [parent, *parent.parents]))
    try:  # (a check of the permissions passes where a filesystem refuses: root in /proc)
        parent.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as e:
        _remove_empty(created)
        raise UserError(
            f"{parent}: cannot make a folder there ({e.strerror or e}); point it at a directory "
            f"you can write to"
        ) from None
    try:
        yield path
    finally:
        for _ in range(50):  # (a stopped save's writer thread may still add a file: ~5 s)
            shutil.rmtree(path, ignore_errors=True)
            if not (path.exists() or path.is_symlink()):
                break
            time.sleep(0.1)
        _remove_empty(created)


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (innermost first: only ones a block made) where they are empty."""
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def absent(path: Path) -> bool:
    """Nothing at `path`, not even a dangling symlink."""
    return not (path.exists() or path.is_symlink())


def same_file(a: Path, b: Path) -> bool:
    """`a` and `b` are one file or folder (False where either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


_HELD: dict[str, OwnerLock] = {}  # lock path -> the holder in this process


class OwnerLock:
    """One process at a time: `path` is held with an exclusive `flock` and names its owner (pid,
    host, start time). The kernel drops a dead owner's flock, so an unflocked file is stale: taken
    over (warned) when its pid on this host has exited, refused for another host or damage. An
    earlier holder in this process that did not release is taken over (one process, one run)."""

    def __init__(self, path: Path, what: str, fix: str):  # fix: how to get past a live owner
        self.path, self.what, self.fix, self._fd = path, what, fix, None

    def check(self) -> None:
        """Refuse now (creating nothing) if a live process holds the lock."""
        if self._fd is not None or absent(self.path) or self._key() in _HELD:  # (acquire: ours)
            return
        if (fd := self._open(create=False)) is None:
            return
        try:
            if not self._try_flock(fd, wait=False):
                raise self._in_use(self._owner_text(fd))
            self._judge(fd, warn=False)  # a stale owner is taken over by acquire (and said then)
        finally:
            os.close(fd)

    def acquire(self, wait: bool = False, on_wait: str | None = None) -> None:
        """Take the lock, or raise UserError naming its owner. With `wait`, block until a live
        owner releases it (logging `on_wait` once first)."""
        if self._fd is not None:
            return
        if (earlier := _HELD.get(self._key())) is not None:
            earlier.release()
        for _ in range(100):  # each retry follows a release that unlinked the file under us
            self.path.parent.mkdir(parents=True, exist_ok=True)  # (and maybe its folder)
            if (fd := self._open(create=True)) is None:
                continue
            try:
                if not self._try_flock(fd, wait=False):
                    if not wait:
                        raise self._in_use(self._owner_text(fd))
                    if on_wait:
                        log.info(on_wait, self._owner_text(fd))
                        on_wait = None
                    self._try_flock(fd, wait=True)
                if not self._same_file(fd):
                    os.close(fd)
                    continue
                self._judge(fd)
                me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
                me["start_ticks"] = _start_ticks(os.getpid())  # (a reused pid: another start)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            _HELD[self._key()] = self
            return
        raise UserError(f"could not take the lock {self.path}; other processes kept racing for it")

    def release(self) -> None:
        if self._fd is None:
            return
        if _HELD.get(self._key()) is self:
            del _HELD[self._key()]
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # while the flock is held: no one else can be judging it
        os.close(self._fd)
        self._fd = None

    def _key(self) -> str:
        return os.path.realpath(self.path)  # (one lock file, however this process named it)

    def _open(self, create: bool) -> int | None:
        if self.path.is_symlink():
            raise UserError(
                f"{self.path} (the lock of {self.what}) is a symlink; scale_llm creates this "
                f"file itself: remove the link"
            )
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            return os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise UserError(
                f"{self.path} (the lock of {self.what}) is a directory; scale_llm creates this "
                f"file itself: move the directory away"
            ) from None
        except PermissionError:  # (another user's launch made it)
            raise UserError(
                f"{self.path} (the lock of {self.what}) cannot be opened for writing by this "
                f"user, so whether a launch holds it cannot be told; {self.fix}, or ask its "
                f"owner (ls -l {self.path})"
            ) from None

    def _try_flock(self, fd: int, wait: bool) -> bool:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        except OSError as e:  # a file system without flock: the owner record alone decides
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        return True

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _read_owner(self, fd: int) -> dict[str, Any] | None:
        """The owner record; {} for an empty file; None for a damaged one."""
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
        return _owner(raw) if raw.strip() else {}

    def _owner_text(self, fd: int) -> str:
        owner = self._read_owner(fd) or {}
        return f"pid {owner['pid']} on {owner['host']}" if owner else "a process that is starting"

    def _in_use(self, owner: str, then: str = "") -> UserError:
        return UserError(
            f"{self.what} is in use by another launch ({owner}, lock file {self.path}); wait for "
            f"it, stop it, or {self.fix}{then}"
        )

    def _judge(self, fd: int, warn: bool = True) -> None:
        """With the flock held: take over a stale owner (with a warning) or refuse."""
        if (owner := self._read_owner(fd)) is None:
            raise UserError(
                f"{self.path} (the lock of {self.what}) is damaged: it does not hold the "
                f'{{"pid", "host", "started"}} record scale_llm writes; if no other launch is '
                f"using {self.what}, delete {self.path}"
            )
        if not owner:  # empty: its creator died before writing (it held the flock till then)
            return
        pid, host, here = owner["pid"], owner["host"], socket.gethostname()
        if host != here:
            raise UserError(
                f"{self.what} is in use by another launch (pid {pid} on {host}, lock file "
                f"{self.path}), which cannot be checked from {here}; {self.fix}. If that process "
                f"is gone (e.g. a job on another node that was killed), delete {self.path}"
            )
        if pid == os.getpid():  # this process, an earlier user of the lock that did not release
            return
        if _holds(owner):  # alive yet not holding the flock: a file system without flock
            then = f". If pid {pid} is not a scale_llm process, delete {self.path}"
            raise self._in_use(f"pid {pid} on {host}", then)
        if warn:
            log.warning(
                f"lock {self.path} was left by pid {pid} on {host}, which has exited; "
                f"taking it over"
            )


def lock_holder(path: Path) -> str | None:
    """Who holds the OwnerLock at `path`: "pid N" (alive, this host), "pid N on HOST", or None.
    Read without taking the flock, which could make a starting owner's non-blocking take fail."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO: no wait)
        try:
            raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if (owner := _owner(raw)) is None:
        return None
    pid, host = owner["pid"], owner["host"]
    if host != socket.gethostname():
        return f"pid {pid} on {host}"
    return f"pid {pid}" if _holds(owner) else None


def _owner(raw: bytes) -> dict[str, Any] | None:
    """An owner record {"pid": int, "host": str, ...}, or None: longer than a record, not JSON,
    nested (`parse_json` bounds the decoder) or of another shape."""
    try:
        owner = parse_json(raw, max_depth=2) if len(raw) <= MAX_RECORD_BYTES else None
    except JSONProblem:
        return None
    pid = owner.get("pid") if isinstance(owner, dict) else None
    ok = isinstance(pid, int) and not isinstance(pid, bool) and isinstance(owner.get("host"), str)
    return owner if ok else None


def _holds(owner: dict[str, Any]) -> bool:
    """Whether the owner record's process (of this host) is alive: its pid names the process
    that started when the record says (a later one may have been given a killed owner's pid)."""
    pid, ticks, taken = owner["pid"], owner.get("start_ticks"), owner.get("started")
    if not _alive(pid):
        return False
    if (started := _start_ticks(pid)) is None:
        return True  # (no /proc to tell: alive)
    if isinstance(ticks, int) and not isinstance(ticks, bool):
        return started == ticks
    if not isinstance(taken, (int, float)) or isinstance(taken, bool):
        return True
    with contextlib.suppress(OSError, ValueError, StopIteration):  # (a record without ticks)
        lines = Path("/proc/stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in lines if line.startswith("btime "))
        return boot + started / os.sysconf("SC_CLK_TCK") <= taken + 2  # (btime: whole seconds)
    return True


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd field)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with contextlib.suppress(PermissionError):  # (another user's process: alive)
            os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    return True
