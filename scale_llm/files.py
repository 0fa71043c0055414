"""Files the commands write: durable writes, publication by rename, ownership, and locks.

The one place for how scale_llm writes to disk, so every command keeps the same promises:
- a file or folder appears complete or not at all (written under a temporary name, flushed to
  disk, renamed into place, the directory entry flushed too);
- a command deletes or replaces only what it can prove it created: a folder carrying the marker
  `mark_owned` wrote (with the kind of thing it is), or a name the command itself just made;
- one process at a time builds a folder or trains in a run dir (`OwnerLock`);
- a folder a user names is read without running its Python or following links out of it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scale_llm.errors import UserError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- durable writes
def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (a rename or a new file in it survives a power cut)."""
    fsync_file(path)


def fsync_tree(root: Path | str) -> None:
    """Every regular file below `root`, then every directory (symlinks are not followed)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


def temporary_sibling(path: Path, tag: str = "tmp") -> Path:
    """A name beside `path` that no other process uses: `.NAME.tag-PID-RANDOM`."""
    return path.parent / f".{path.name}.{tag}-{os.getpid()}-{os.urandom(3).hex()}"


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write `data` to `path` atomically and durably: readers see the old file or the new one.
    A symlink or a special file at `path` is not written through: it is an error."""
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
    if path.is_symlink():
        return "a symlink"
    if path.is_dir():
        return "a directory"
    if path.is_fifo():
        return "a named pipe"
    if path.is_socket():
        return "a socket"
    if path.is_block_device() or path.is_char_device():
        return "a device"
    if path.is_file():
        return "a file"
    return "missing"


def unwritable_dir(path: Path | str) -> tuple[Path, str] | None:
    """Why `path` is not, and cannot become, a writable directory: (the first existing part of
    the path, "file" when it is not a directory or "read-only" when this user cannot write
    there); None when it is or can be made one."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return existing, "file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return existing, "read-only"
    return None


def require_writable_dir(path: Path | str, key: str) -> None:
    """Before any work: `path` (the value of config key `key`) is, or can become, a writable
    directory. Names the first existing part of the path that is a file or read-only."""
    problem = unwritable_dir(path)
    if problem is None:
        return
    existing, why = problem
    if why == "file":
        raise UserError(
            f"{key}={path}: {existing} is a file, not a directory; point {key} at a directory "
            f"(or move the file away)"
        )
    raise UserError(
        f"{key}={path}: {existing} is not writable by this user; point {key} at a "
        f"directory you can write to"
    )


# ----------------------------------------------------------------------------- reading JSON
# Every JSON file or line the project reads goes through `parse_json`: bounded in size and in
# nesting, so a hostile file gives one UserError (or a skipped line), never a MemoryError or a
# RecursionError from the decoder. What the project writes nests at most ~6 deep; Hugging Face
# configs and tokenizer files about 10.
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
    if _depth_above(value, max_depth):
        raise JSONProblem(f"nested deeper than {max_depth} levels")
    return value


def _depth_above(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` containers deep (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def read_json(
    path: Path | str,
    what: str,
    fix: str,
    kind: type = dict,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The JSON value of the regular file `path`, which must be a `kind` (dict or list).
    Anything else (missing, not a regular file, larger than `max_bytes`, not UTF-8 JSON, nested
    deeper than `max_depth`, another type) is a UserError naming the file, `what` it is, and
    `fix`. A symlink is followed (the Hub cache links its blobs); a FIFO is never opened."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise UserError(f"{path} ({what}) cannot be read ({e.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not _stat_is_file(st.st_mode):
            raise UserError(f"{path} ({what}) is not a regular file; {fix}")
        if st.st_size > max_bytes:
            raise UserError(
                f"{path} ({what}) is {st.st_size:,} bytes, more than the {max_bytes:,} such a "
                f"file can hold; {fix}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise UserError(f"{path} ({what}) cannot be read ({e.strerror}); {fix}") from None
    finally:
        os.close(fd)
    try:
        value = parse_json(raw, max_depth)
    except JSONProblem as e:
        raise UserError(f"{path} ({what}) cannot be read as JSON ({e}); {fix}") from None
    if not isinstance(value, kind):
        raise UserError(
            f"{path} ({what}) holds a JSON {_json_kind(value)}, not {_json_kind(kind())}; {fix}"
        )
    return value


def _stat_is_file(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


def _json_kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def read_json_object(path: Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON file that must hold an object (`read_json` with kind=dict)."""
    return read_json(path, what, fix)


# ----------------------------------------------------------------------------- a stranger's folder
# Folders a user names (data.tokenizer, model.init_from) and the exports eval reuses are read into
# what the project writes (hf-tokenizer.json, checkpoints, exports) and handed to transformers.
# Two rules keep their owner's other files out and their Python unrun:
# - a symlink in such a folder is followed only to a regular file inside the folder itself, or
#   inside the Hugging Face cache entry (`models--ORG--NAME`) the folder lies in: the Hub cache
#   links snapshots/REV/FILE to ../../blobs/SHA. A link anywhere else is refused.
# - a folder whose config names custom code (`custom_code_problem`) is refused before
#   transformers reads it; transformers is called with trust_remote_code=False besides.
HUB_ENTRY_PREFIX = "models--"
CODE_KEYS = ("auto_map", "custom_pipelines")  # where transformers looks for a folder's classes
LINK_FIX = "replace the link by the file itself, or remove it"


def folder_file(folder: Path, name: str, what: str) -> Path | None:
    """The path to open for the file `name` of `folder`: itself, or the target of a link the
    rule above admits. None when no regular file of that name is there (a folder, a FIFO, a
    dangling link inside); a UserError for a link that leads out of the folder."""
    path = Path(folder) / name
    if not path.is_symlink():
        return path if path.is_file() else None
    try:
        target = path.resolve()  # every link of a chain followed: judged by where it ends
    except (OSError, RuntimeError):  # a loop
        raise UserError(f"{what}: {path} is a symlink that loops; {LINK_FIX}") from None
    if not any(target.is_relative_to(root) for root in _link_roots(Path(folder))):
        raise UserError(
            f"{what}: {path} is a symlink to {target}, outside {folder}; scale_llm copies a "
            f"folder's files into what it writes (data, checkpoints, exports), so it reads "
            f"only files inside the folder (or inside its Hugging Face cache entry, "
            f"{HUB_ENTRY_PREFIX}ORG--NAME): {LINK_FIX}"
        )
    return target if target.is_file() else None


def _link_roots(folder: Path) -> list[Path]:
    """Where a link in `folder` may lead: the folder, and the Hub cache entry holding it."""
    real = folder.resolve()
    entries = [p for p in (real, *real.parents) if p.name.startswith(HUB_ENTRY_PREFIX)]
    return [real, *entries[:1]]


def read_folder_file(
    folder: Path, name: str, what: str, max_bytes: int = MAX_JSON_BYTES
) -> bytes | None:
    """The bytes of the file `name` of `folder` (None: no such regular file), found by
    `folder_file` and opened without following a link (O_NOFOLLOW; fstat: a regular file)."""
    path = folder_file(folder, name, what)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:  # ELOOP: replaced by a link since it was checked
        raise UserError(f"{what}: {Path(folder) / name} cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not _stat_is_file(st.st_mode) or st.st_size > max_bytes:
            raise UserError(
                f"{what}: {Path(folder) / name} is not a regular file of at most {max_bytes:,} "
                f"bytes; give a folder whose files are regular files"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes + 1)
    finally:
        os.close(fd)


def custom_code_problem(folder: Path, what: str) -> str | None:
    """Why transformers would run Python from `folder` (None: it would not): a config
    (`*config.json`) holding `auto_map` or `custom_pipelines`, or naming a `.py` file the folder
    holds (e.g. "tokenizer_class": "evil_tok.EvilTokenizer" beside evil_tok.py)."""
    folder = Path(folder)
    modules = {p.stem for p in folder.glob("*.py")}
    for config in sorted(folder.glob("*config.json")):
        path = folder_file(folder, config.name, what)
        if path is None:
            continue
        value = read_json(path, f"{what}'s {config.name}", "fix or remove the file", kind=object)
        found = _code_reference(value, modules)
        if found:
            key, item, module = found
            said = f"{module}.py, Python in the folder" if module else "custom code"
            return (
                f"{config} names {said} ({key}: {_cut(item)}); scale_llm never runs Python "
                f"from a model folder (transformers' trust_remote_code stays off): remove "
                f"{key} from {config.name} if transformers' own classes read the model, or "
                f"give a folder without custom code"
            )
    return None


def _code_reference(value: Any, modules: set[str]) -> tuple[str, Any, str | None] | None:
    """(key, value, module or None) of the first entry naming code: a CODE_KEYS key first,
    else a string naming one of `modules`."""
    items = list(_json_items(value))
    for key, item in items:
        if key.rsplit(".", 1)[-1] in CODE_KEYS:
            return key, item, None
    for key, item in items:
        module = _module_named(item, modules)
        if module:
            return key, item, module
    return None


def _json_items(value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every entry of a JSON value, iteratively (read_json bounded it)."""
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
    """The module of `modules` a config string names: "mod", "mod.py", "mod.Class", or a
    Hub reference "repo--mod.Class"."""
    if not isinstance(item, str) or not modules:
        return None
    ref = item.rsplit("--", 1)[-1].removesuffix(".py")
    head = ref.split(".", 1)[0]
    return head if head in modules else None


def _cut(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- ownership
OWNER_MARKER = ".scale-llm-owner.json"  # in a folder a command created and may remove again
MAX_RECORD_BYTES = 4096  # an owner record or marker: {"kind", "pid", "host", "at"}, ~100 bytes


def make_owned_dir(path: Path, kind: str) -> Path:
    """Create the folder `path` (it must not exist: an existing folder is not ours) with the
    ownership marker of `kind` inside; returns it."""
    path.mkdir(parents=False, exist_ok=False)
    atomic_write_json(path / OWNER_MARKER, {"kind": kind, "pid": os.getpid(), "at": time.time()})
    return path


def owned_kind(path: Path) -> str | None:
    """The kind recorded by `make_owned_dir` in folder `path`, or None (not ours, or damaged).
    A symlink is never ours: removing it would remove what it points to, or nothing."""
    if path.is_symlink() or not path.is_dir():
        return None
    marker = path / OWNER_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        kind = read_json(marker, "ownership marker", "", max_bytes=MAX_RECORD_BYTES).get("kind")
    except UserError:  # unreadable, too large, not JSON, too deep, not an object: not ours
        return None
    return kind if isinstance(kind, str) else None


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


@contextlib.contextmanager
def private_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder inside `parent` that only this block uses (`tempfile.mkdtemp`: a fresh
    name, so nothing that was there before is touched); removed at the end. `parent` is
    created if missing, and removed again if this block created it and left it empty."""
    created = []
    for p in [parent, *parent.parents]:
        if p.exists() or p.is_symlink():
            break
        created.append(p)
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        for p in created:  # innermost first; only folders this block made, only when empty
            with contextlib.suppress(OSError):
                p.rmdir()


# ----------------------------------------------------------------------------- locks
_HELD: dict[str, OwnerLock] = {}  # lock path -> the holder in this process


class OwnerLock:
    """One process at a time: `path` is held open with an exclusive `flock` for as long as the
    lock is held, and names its owner (pid, host, start time) for the message others get.

    The kernel drops the flock when the owner dies, however it dies, so a lock file with no
    flock on it is stale: taken over with a warning when its owner is a process of this host
    that has exited, refused when it names another host (a file system without cross-host
    locks cannot tell) or is damaged. The file is created and filled by the process holding
    the flock, and checked to still be the file at `path` after locking (a concurrent release
    unlinks it), so two processes can never both hold it. Within one process, a new holder
    takes the lock over from an earlier one that did not release it (one process, one run:
    an earlier Trainer object of the same process is done).
    """

    def __init__(self, path: Path, what: str, fix: str):
        self.path = path
        self.what = what  # e.g. "runs/tiny" or "data.dir=data/tiny"
        self.fix = fix  # how to get past a live owner, e.g. "pick another run.name"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def check(self) -> None:
        """Refuse now (creating nothing) if a live process holds the lock."""
        if self.held or not (self.path.exists() or self.path.is_symlink()):
            return
        if self._key() in _HELD:  # this process holds it: acquire takes it over
            return
        fd = self._open(create=False)
        if fd is None:
            return
        try:
            if not self._try_flock(fd, wait=False):
                self._refuse_live(fd)
            self._judge(fd, warn=False)  # a stale owner is taken over by acquire (and said then)
        finally:
            os.close(fd)

    def acquire(self, wait: bool = False, on_wait: str | None = None) -> None:
        """Take the lock, or raise UserError naming its owner. With `wait`, block until a live
        owner releases it (logging `on_wait` once first)."""
        if self.held:
            return
        earlier = _HELD.get(self._key())
        if earlier is not None:
            earlier.release()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # each retry follows a release that unlinked the file under us
            fd = self._open(create=True)
            if fd is None:
                continue
            try:
                if not self._try_flock(fd, wait=False):
                    if not wait:
                        self._refuse_live(fd)
                    if on_wait:
                        log.info(on_wait, self._owner_text(fd))
                        on_wait = None
                    self._try_flock(fd, wait=True)
                if not self._same_file(fd):
                    os.close(fd)
                    continue
                self._judge(fd)
                me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
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

    # --------------------------------------------------------------- internals
    def _key(self) -> str:
        return os.path.abspath(self.path)

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
        """The owner record; {} for an empty file; None for a damaged one (not JSON, nested
        too deep, longer than a record)."""
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
        if not raw.strip():
            return {}
        try:
            owner = _owner_json(raw)
        except JSONProblem:
            return None
        ok = (
            isinstance(owner, dict)
            and isinstance(owner.get("pid"), int)
            and not isinstance(owner.get("pid"), bool)
            and isinstance(owner.get("host"), str)
        )
        return owner if ok else None

    def _owner_text(self, fd: int) -> str:
        owner = self._read_owner(fd) or {}
        if "pid" not in owner:
            return "a process that is starting"
        return f"pid {owner['pid']} on {owner['host']}"

    def _refuse_live(self, fd: int) -> None:
        raise UserError(
            f"{self.what} is in use by another launch ({self._owner_text(fd)}, lock file "
            f"{self.path}); wait for it, stop it, or {self.fix}"
        )

    def _judge(self, fd: int, warn: bool = True) -> None:
        """With the flock held: take over a stale owner (with a warning) or refuse."""
        owner = self._read_owner(fd)
        if owner is None:
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
        if _alive(pid):  # alive yet not holding the flock: pid reuse, or an older scale_llm
            raise UserError(
                f"{self.what} is in use by another launch (pid {pid} on {host}, lock file "
                f"{self.path}); wait for it, stop it, or {self.fix}. If pid {pid} is not a "
                f"scale_llm process, delete {self.path}"
            )
        if warn:
            log.warning(
                "lock %s was left by pid %d on %s, which has exited; taking it over",
                self.path,
                pid,
                host,
            )


def lock_holder(path: Path) -> str | None:
    """Who holds the OwnerLock at `path`, read without locking or writing anything: "pid N" for
    a live process of this host, "pid N on HOST" for another host's (which cannot be checked
    from here), None when the file is absent, unreadable, or names a process that has exited.
    (A reader that took the flock, even shared, could make a starting owner's non-blocking
    take fail; the record the owner writes is enough to tell.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO: no wait)
    except OSError:
        return None
    try:
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        owner = _owner_json(raw)
    except JSONProblem:
        return None
    pid, host = (owner.get("pid"), owner.get("host")) if isinstance(owner, dict) else (None, None)
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return None
    if host != socket.gethostname():
        return f"pid {pid} on {host}"
    return f"pid {pid}" if _alive(pid) else None


def _owner_json(raw: bytes) -> Any:
    """An owner record's JSON value: JSONProblem when it is longer than a record, not JSON or
    nested deeper than a record (a record never nests: `parse_json` bounds the decoder)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise JSONProblem(f"longer than {MAX_RECORD_BYTES} bytes")
    return parse_json(raw, max_depth=2)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
