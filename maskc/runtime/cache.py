"""Kernel cache: generated sources by signature, in memory and on disk.

Files are named for people (`fwd_<hash of the KernelSource>.py`), written atomically and only
when missing. The first line of each holds the sha256 of the rest, and the second names the
kernel it holds, checked when the file is read: a file that fails either (edited, truncated,
garbage, or another kernel's file under this name) is rendered again and replaced, with a
warning. What runs is the text checked, never the file read again nor bytecode of it
(loader.load). A cache directory that cannot be written (read-only, or a file) still serves the
kernels it holds; new ones go to a private temporary directory for the rest of the process,
with a warning. One that another user could write (theirs, or writable by its group or others,
as ssh refuses key files) is neither read nor written: the process works in a private temporary
directory, with a warning. `MASKC_CACHE_DIR` overrides the location; `MASKC_DEBUG=1` prints
each source as it is rendered or read (maskc/settings.py).

Care of the directory (`maskc cache`): the second line of each file records what made it
(maskc's version, the codegen hash, Triton's version, the mask), so that entries no install of
this version can read again are known as stale. A file's access time is its last use: maskc
sets it whenever a process reads or loads the file. MASKC_CACHE_MAX_SIZE caps the kernels'
size: after each write the least recently used files go until the rest fit. Deleting never
races a load: what a process runs is the text it checked, which it holds, and Triton reads a
kernel's source from that text too, so a file deleted after the check changes nothing. The
file is written again when the process loads the kernel, so that its path shows what runs;
meanwhile the process holds a shared lock (flock on the directory), which deletions take
exclusively.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import grp
import hashlib
import json
import logging
import os
import pwd
import shutil
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

from maskc._slots import Slots
from maskc.runtime import state
from maskc.settings import cache_dir, cache_max_size, debug

_log = logging.getLogger(__name__)


class CacheInfo(NamedTuple):
    """hits: kernels found in memory; misses: kernels rendered by this process;
    disk_hits: kernels read from disk without rendering; currsize: kernels in memory."""

    hits: int
    misses: int
    disk_hits: int
    currsize: int


class SourceCache:
    """Signature -> CompiledKernel in memory (the `size` least recently used); signature ->
    source file on disk."""

    def __init__(self, size: int):
        self._memory = Slots(size)
        self._lock = threading.Lock()
        self._spares: dict[Path, Path] = {}  # unwritable or untrusted cache directory -> the temporary one
        self._distrusted: set[Path] = set()  # cache directories neither read nor written (untrusted())
        self.hits = self.misses = self.disk_hits = 0

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.disk_hits, len(self._memory))

    def clear(self) -> None:
        """Forget the in-memory kernels and the counters (files on disk stay)."""
        with self._lock:
            self._memory.clear()
            self.hits = self.misses = self.disk_hits = 0

    def get(self, key):
        kernel = self._memory.get(key)
        if kernel is not None:
            self.hits += 1
        return kernel

    def put(self, key, kernel) -> None:
        self._memory.put(key, kernel)

    def source(self, name: str, render, tags: dict | None = None) -> tuple[str, Path]:
        """The source stored under `name` and its file, rendering (and writing) it, with `tags`
        and `name` on its second line, where the file is missing, fails its hash or holds
        another kernel."""
        home, limit, show = cache_dir(), cache_max_size(), debug()  # every setting checked before any file
        with self._lock:
            self._check_trust(home)
            start = time.perf_counter()
            text, path = self._stored(home, name)
            if text is not None:
                self.disk_hits += 1
                _log.info("read %s from %s", name, path.parent)
            else:
                self.misses += 1
                text = stamped(render(), {**(tags or {}), "kernel": name})
                path = self._store(home, name, text)
                _log.info("rendered %s in %.0f ms into %s", name, (time.perf_counter() - start) * 1e3, path.parent)
                if path.parent == home and limit is not None:
                    self._cap(home, path, limit)
        if show:
            print(f"# maskc kernel {path}\n{text}")
        return text, path

    def _check_trust(self, home: Path) -> None:
        """Stop reading and writing `home` for the rest of the process, with a warning, where
        another user could write it (checked on each disk lookup: its mode may change)."""
        if home in self._distrusted:
            return
        found = untrusted(home)
        if found is not None:
            why, fix = found
            self._distrusted.add(home)
            warnings.warn(f"maskc does not trust its cache directory {home}, {why}: another user could put code "
                          f"there that maskc would run; this process neither reads nor writes it and keeps its "
                          f"kernels in the private temporary directory {self._spare(home)}, deleted at exit; {fix}")

    def _stored(self, home: Path, name: str) -> tuple[str | None, Path | None]:
        """The intact file of `name` in `home` or in its spare, as (text, path); else (None, None)."""
        spare = self._spares.get(home)
        for directory in (spare,) if home in self._distrusted else (home, spare):
            text = _read(directory / f"{name}.py", name)[0] if directory is not None else None
            if text is not None:
                _touch(directory / f"{name}.py")
                return text, directory / f"{name}.py"
        return None, None

    @contextlib.contextmanager
    def loading(self, path: Path, text: str):
        """Yields the file of `text` while the process loads it: `path` while it still holds
        `text`, else `text` written again, so that the file Triton's messages name shows what
        runs (what runs is `text` itself: loader.load). No `maskc cache` deletion removes it
        until the block ends."""
        with _locked(path.parent, fcntl.LOCK_SH):
            with self._lock:
                if _read(path, path.stem)[0] != text:
                    path = self._store(path.parent, path.stem, text)
            _touch(path)
            yield path

    def _cap(self, home: Path, written: Path, limit: int) -> None:
        """Delete the least recently used kernels of `home` (not the one just `written`) until
        the rest fit `limit` bytes (MASKC_CACHE_MAX_SIZE). Skipped while another process loads
        a kernel there: the next write tries again."""
        with _locked(home, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
            if not held:
                return
            found = [e for e in entries(home) if e.path != written]
            over = least_recently_used(found, limit - written.stat().st_size)
            freed = _unlink(over)
        if over:
            _log.info("deleted %d least recently used kernel files (%d bytes) from %s to keep MASKC_CACHE_MAX_SIZE",
                      len(over), freed, home)

    def _store(self, home: Path, name: str, text: str) -> Path:
        """Write `text` as `name` in `home`, or in its spare once `home` proved unwritable or
        untrusted."""
        spare = self._spares.get(home)
        path = (spare or home) / f"{name}.py"
        damage = _read(path, name)[1]  # there, but it failed its hash or holds another kernel
        try:
            write_atomic(path, text)
        except OSError as error:
            if spare is not None:
                raise
            warnings.warn(f"maskc cannot write kernels to its cache directory {home} ({type(error).__name__}: "
                          f"{error}); this process keeps new kernels in the private temporary directory "
                          f"{self._spare(home)}, deleted at exit; set MASKC_CACHE_DIR to a writable directory to keep "
                          f"them")
            return self._store(home, name, text)
        if damage:
            warnings.warn(f"maskc kernel file {path} {damage}; it was rendered again and replaced")
        return path

    def _spare(self, home: Path) -> Path:
        """The private temporary directory that keeps `home`'s new kernels, deleted at exit."""
        if home not in self._spares:
            self._spares[home] = Path(tempfile.mkdtemp(prefix="maskc-kernels-"))
            atexit.register(shutil.rmtree, self._spares[home], ignore_errors=True)
        return self._spares[home]


_STAMP = "# maskc sha256 "
_TAGS = "# maskc provenance "


def stamped(text: str, tags: dict | None = None) -> str:
    """`text` under a line of `tags` (what made it) and a first line holding the sha256 of
    both: what a cached kernel file holds."""
    if tags:
        text = f"{_TAGS}{json.dumps(tags, sort_keys=True)}\n{text}"
    return f"{_STAMP}{hashlib.sha256(text.encode()).hexdigest()}\n{text}"


def _read(path: Path, name: str) -> tuple[str | None, str | None]:
    """(text, None) where the file at `path` matches the sha256 on its first line and its tag
    line names the kernel `name`; else (None, what is wrong with it), the latter None where
    there is no file to read."""
    try:
        data = path.read_bytes()
    except OSError:  # missing, or the cache directory is not a directory
        return None, None
    head, _, body = data.partition(b"\n")
    if head.decode("latin-1") != _STAMP + hashlib.sha256(body).hexdigest():
        return None, "did not match the sha256 on its first line (edited, truncated or corrupted)"
    # NOTE: a hash proves a file whole, not which kernel it is: another kernel's intact file
    # copied or renamed over this one would run in its place
    kernel = _tags(body.partition(b"\n")[0].decode("utf-8", "replace")).get("kernel")
    if kernel != name:
        return None, (f"holds the kernel {kernel}, not {name} (another kernel's file copied or renamed over it)"
                      if kernel else "does not name the kernel it holds (an older maskc wrote it)")
    try:
        return data.decode(), None
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"


def _touch(path: Path) -> None:
    """Record a use of `path` in its access time (its modification time stays the write's):
    what least_recently_used() orders by, whatever the file system's atime policy."""
    try:
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
    except OSError:  # a read-only cache, or another user's file: its uses go unrecorded
        pass


def untrusted(home: Path) -> tuple[str, str] | None:
    """Why another user could write the directory `home`, and the fix; None where only this
    user (and root) can: it is theirs or root's, and neither others nor its group may write it,
    but for a group of the owner alone (the user private groups of a umask 002). A directory
    that does not exist yet, or is not one, holds nothing to trust."""
    try:
        found = home.stat()  # through a symlink: what is trusted is the directory that holds the files
    except OSError:
        return None
    if not stat.S_ISDIR(found.st_mode):
        return None
    if found.st_uid not in (os.getuid(), 0):
        try:
            owner = f" ({pwd.getpwuid(found.st_uid).pw_name})"
        except KeyError:  # no such user on this machine
            owner = ""
        return (f"owned by uid {found.st_uid}{owner}, not by you (uid {os.getuid()})",
                "set MASKC_CACHE_DIR to a directory you own")
    if found.st_mode & 0o002 or (found.st_mode & 0o020 and not _private_group(found)):
        return (f"mode {oct(stat.S_IMODE(found.st_mode))}: writable by its group or others",
                f"run `chmod go-w {home}` or set MASKC_CACHE_DIR to a directory only you can write")
    return None


def _private_group(found: os.stat_result) -> bool:
    try:
        owner, group = pwd.getpwuid(found.st_uid).pw_name, grp.getgrgid(found.st_gid)
    except KeyError:
        return False
    return group.gr_name == owner and set(group.gr_mem) <= {owner}


# -- the directory's contents, for `maskc cache` and MASKC_CACHE_MAX_SIZE ----------------------
class Entry(NamedTuple):
    """A kernel file: `written` and `used` are times (seconds since the epoch); `tags` what
    made it ({} for files written before maskc recorded it)."""

    path: Path
    size: int
    written: float
    used: float
    tags: dict


def entries(home: Path) -> list[Entry]:
    """The kernel files in `home` (those whose first line is maskc's stamp), oldest use first."""
    found = []
    for path in home.glob("*.py") if home.is_dir() else ():
        try:
            stat = path.stat()  # before reading: the read may set the access time, which is the last use
            with _unused(path) as f:
                head, tags = f.readline().decode("latin-1"), f.readline().decode("utf-8", "replace")
        except OSError:  # deleted meanwhile
            continue
        if head.startswith(_STAMP):
            found.append(Entry(path, stat.st_size, stat.st_mtime, stat.st_atime, _tags(tags)))
    return sorted(found, key=lambda e: (e.used, e.written, e.path.name))


def _unused(path: Path):
    """`path` opened for reading without counting as a use where the system allows.
    NOTE: relatime mounts update the access time on a read whenever it is older than the
    last change of the file's metadata, which _touch() itself makes: every listing would then
    mark every kernel used. O_NOATIME (Linux, for the file's owner) keeps it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
    except PermissionError:  # O_NOATIME on another user's file
        fd = os.open(path, os.O_RDONLY)
    return os.fdopen(fd, "rb")


def _tags(line: str) -> dict:
    if not line.startswith(_TAGS):
        return {}
    try:
        tags = json.loads(line[len(_TAGS):])
    except ValueError:
        return {}
    return tags if isinstance(tags, dict) else {}


def least_recently_used(found: list[Entry], limit: int) -> list[Entry]:
    """The entries to delete, least recently used first, for the rest to fit in `limit` bytes."""
    total = sum(e.size for e in found)
    chosen = []
    for e in sorted(found, key=lambda e: (e.used, e.written, e.path.name)):
        if total <= limit:
            break
        chosen.append(e)
        total -= e.size
    return chosen


# A write (write_atomic) takes milliseconds: a temporary file this old was left by a process
# that died mid-write, and one younger may be another process's write in progress.
TEMPORARY_AGE = 3600.0


def leftovers(home: Path) -> list[Path]:
    """Temporary files in `home` left by writes that never finished."""
    now = time.time()
    found = []
    for path in home.glob("*.tmp") if home.is_dir() else ():
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > TEMPORARY_AGE:
                found.append(path)
    return found


def bytecode(home: Path) -> list[Path]:
    """The bytecode directory that older maskc versions' imports of kernels left in `home`
    (maskc runs the text it checked, and writes none)."""
    path = home / "__pycache__"
    return [path] if path.is_dir() and not path.is_symlink() else []


def remove(home: Path, paths: list[Path], wait: float = 10.0) -> int:
    """Delete `paths` (files, or directories and all they hold) from `home` once no process is
    loading a kernel there (waiting up to `wait` seconds); the bytes freed. Raises TimeoutError
    when the wait runs out."""
    deadline = time.monotonic() + wait
    while True:
        with _locked(home, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
            if held:
                return _unlink(paths)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"another process kept loading kernels from {home} for {wait:g} s, so nothing was "
                               f"deleted; try again once it is done")
        time.sleep(0.05)


def _unlink(items) -> int:
    freed = 0
    for item in items:
        path = item.path if isinstance(item, Entry) else item
        try:
            if path.is_dir() and not path.is_symlink():
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            else:
                size = path.stat().st_size
                path.unlink()
        except FileNotFoundError:  # another process deleted it first
            continue
        freed += size
    return freed


@contextlib.contextmanager
def _locked(directory: Path, mode: int):
    """flock `mode` on `directory` for the block; yields whether it is held. A directory that
    cannot be opened (missing, or a file) has nothing to protect, nor a file system without
    flock (some network mounts): there the block runs unlocked.
    NOTE: the directory itself is locked, not a lock file in it, so that the cache holds only
    kernels and the files maskc documents."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, mode)
            held = True
        except BlockingIOError:
            held = False
        except OSError:
            held = True
        yield held
    finally:
        os.close(fd)  # which releases the lock


def write_atomic(path: Path, text: str) -> None:
    # a directory made here is private whatever the umask: untrusted() refuses one that others
    # could write (mkstemp's files are the user's alone already)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# A kernel dropped from memory is read again from its file (and Triton's binary from Triton's
# cache) by the next call that needs it; the plans that hold it keep it meanwhile.
MAX_KERNELS = 256
KERNELS = SourceCache(MAX_KERNELS)
state.register(__name__, "KERNELS", "the CompiledKernel of each kernel source: its loaded module and Triton's binaries",
               f"{MAX_KERNELS} kernels, least recently used dropped first (the files on disk stay)",
               size=lambda: KERNELS.info().currsize, clear=KERNELS.clear, maxsize=MAX_KERNELS)
