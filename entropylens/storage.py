"""Where runs live: a local directory or an object-store URL (``s3://bucket/prefix``, or any other
fsspec / pyarrow filesystem URL), behind one small :class:`Location` type.

Credentials and endpoint come from the standard AWS environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``; botocore reads them) or from
a ``storage_options`` dict passed to fsspec (``{"endpoint_url": ..., "key": ..., "secret": ...}``).

Atomic writes (a reader never sees half a file, a killed writer leaves none):
- local: write a hidden ``.NAME.PID.tmp`` that no ``*.parquet`` glob matches, then ``os.replace``;
- object storage: an object appears whole or not at all, so the whole file goes up in one PUT under
  its final name (``pipe_file``), or, for large files, a multipart upload that is completed only
  after its last part (``put_file``). Nothing is ever written in place.

DuckDB reads remote files through the same fsspec filesystem (``register_filesystem``), so no
DuckDB extension (httpfs) is downloaded at run time.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCAL_PROTOCOLS = ("file", "local")


def _fsync_path(path: str) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data, fsync: bool) -> None:
    """Write ``data`` to a new local file through one descriptor (fsync'd through it when ``fsync``)."""
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0), 0o666
    )
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class StorageError(ValueError):
    """A location that cannot be used (unknown protocol, missing filesystem package)."""


def _split_url(url: str) -> tuple[str, str]:
    """'s3://b/p' -> ('s3', 'b/p'); a plain path -> ('file', path)."""
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto.lower(), rest
    return "file", url


@dataclass(frozen=True)
class Location:
    """A path on one filesystem. ``path`` has no protocol; ``str(loc)`` is the URL (or local path)."""

    protocol: str
    path: str
    options: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ---------------------------------------------------------------- naming
    @property
    def remote(self) -> bool:
        return self.protocol not in LOCAL_PROTOCOLS

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def parent(self) -> Location:
        return self.at(posixpath.dirname(self.path.rstrip("/")))

    def at(self, path: str) -> Location:
        """The same filesystem at another (protocol-less) path, e.g. one returned by a listing."""
        return Location(self.protocol, path, self.options)

    def __truediv__(self, part: str | os.PathLike) -> Location:
        return self.at(posixpath.join(self.path, str(part)))

    def url(self, path: str | None = None) -> str:
        """What DuckDB, users and messages see: a local path, or protocol://path."""
        p = self.path if path is None else path
        return p if not self.remote else f"{self.protocol}://{p}"

    def __str__(self) -> str:
        return self.url()

    def relative(self, other: Location) -> str:
        return posixpath.relpath(other.path, self.path)

    # ---------------------------------------------------------------- filesystem
    @property
    def fs(self):
        return filesystem(self.protocol, self.options)

    def exists(self) -> bool:
        if not self.remote:
            return os.path.exists(self.path)
        self.fs.invalidate_cache(self.path)
        return self.fs.exists(self.path)

    def isdir(self) -> bool:
        return os.path.isdir(self.path) if not self.remote else self.fs.isdir(self.path)

    def isfile(self) -> bool:
        return os.path.isfile(self.path) if not self.remote else self.fs.isfile(self.path)

    def files(self) -> dict[str, int]:
        """Every file at or under this location: protocol-less path -> size in bytes. Hidden names
        (``.*``: temporaries) are left out. One listing (a LIST per 1,000 objects on S3)."""
        if not self.remote:
            out = {}
            for dirpath, dirnames, filenames in os.walk(self.path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for f in filenames:
                    if not f.startswith("."):
                        p = os.path.join(dirpath, f)
                        try:
                            out[p] = os.stat(p).st_size
                        except FileNotFoundError:  # removed while listing (compaction)
                            pass
            return out
        self.fs.invalidate_cache(self.path)  # s3fs caches listings: a reader must see new files
        found = self.fs.find(self.path, detail=True)
        return {
            p: int(i.get("size") or 0)
            for p, i in found.items()
            if i.get("type", "file") == "file" and not any(s.startswith(".") for s in p.split("/"))
        }

    def read_bytes(self) -> bytes:
        if not self.remote:
            return Path(self.path).read_bytes()
        return self.fs.cat_file(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def tails(self, sizes: dict[str, int], n: int) -> list[bytes | Exception]:
        """The last ``n`` bytes of each file (path -> size from a listing): one ranged GET each,
        concurrent on object storage. A failed read is returned as its exception."""
        paths = list(sizes)
        if not self.remote:
            out: list[bytes | Exception] = []
            for p in paths:
                try:
                    with open(p, "rb") as f:
                        size = f.seek(0, 2)
                        f.seek(max(0, size - n))
                        out.append(f.read())
                except OSError as e:
                    out.append(e)
            return out
        if not paths:
            return []
        ends = [sizes[p] for p in paths]
        res = self.fs.cat_ranges(paths, [max(0, e - n) for e in ends], ends, on_error="return")
        return list(res)

    def mkdirs(self) -> None:
        if not self.remote:
            os.makedirs(self.path, exist_ok=True)
        # object stores have no directories

    def write_bytes(self, data: bytes | bytearray | memoryview, *, fsync: bool = False) -> None:
        """Atomically replace this file with ``data`` (see the module docstring)."""
        if self.remote:
            self.fs.pipe_file(self.path, bytes(data))
            return
        # written and fsync'd through one descriptor (no second open to fsync it by path)
        self.write_with(lambda tmp: _write_file(tmp, data, fsync), fsync=fsync, filled_synced=True)

    def write_text(self, text: str, *, fsync: bool = False) -> None:
        self.write_bytes(text.encode(), fsync=fsync)

    def write_with(self, fill: Callable[[str], Any], *, fsync: bool = False, filled_synced: bool = False) -> None:
        """``fill(tmp_path)`` writes the whole file to a local temporary path; it then appears here
        atomically (rename, or one upload completed only when whole). Large files go this way.
        ``filled_synced``: ``fill`` has fsync'd the file itself (only the directory is left)."""
        if self.remote:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="entropylens-") as d:
                tmp = os.path.join(d, self.name)
                fill(tmp)
                if os.path.getsize(tmp) <= 64 << 20:
                    self.fs.pipe_file(self.path, Path(tmp).read_bytes())  # one PUT
                else:
                    self.fs.put_file(tmp, self.path)  # multipart, completed after the last part
            return
        parent = os.path.dirname(self.path) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{self.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fill(tmp)
            if fsync and not filled_synced:
                _fsync_path(tmp)
            os.replace(tmp, self.path)
            if fsync:
                _fsync_path(parent)  # the rename itself
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def create_exclusive(self, data: bytes) -> bool:
        """Create this file holding ``data`` only if no file is here: True if this call created it,
        False if a file was here already (it is never replaced). Of writers racing for one path,
        however close in time, exactly one gets True. Locally ``O_CREAT | O_EXCL``, then the bytes,
        fsync'd (a reader may see the file empty for that moment); object storage: one conditional
        PUT (S3 ``If-None-Match: *``, s3fs's ``mode="create"``), whole or not at all."""
        if self.remote:
            try:
                self.fs.pipe_file(self.path, bytes(data), mode="create")
            except FileExistsError:  # s3fs: 412 Precondition Failed
                return False
            return True
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o666)
        except FileExistsError:
            return False
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def remove(self) -> None:
        if not self.remote:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass


_FS_CACHE: dict = {}


def filesystem(protocol: str, options: dict | None = None):
    """The fsspec filesystem for ``protocol`` (cached per protocol + options)."""
    key: tuple[str, object] = (protocol, tuple(sorted((options or {}).items(), key=lambda kv: kv[0])))
    try:
        hash(key)
    except TypeError:
        key = (protocol, repr(sorted((options or {}).items())))
    fs = _FS_CACHE.get(key)
    if fs is None:
        try:
            import fsspec

            fs = fsspec.filesystem(protocol, **(options or {}))
        except ImportError as e:
            raise StorageError(
                f"{protocol}:// needs an extra package ({e.name or e}): pip install 'entropylens[s3]'"
            ) from None
        except ValueError as e:
            raise StorageError(f"unsupported storage URL {protocol}://: {e}") from None
        _FS_CACHE[key] = fs
    return fs


def location(path: str | os.PathLike | Location, storage_options: dict | None = None) -> Location:
    """A :class:`Location` for a local path or a URL (``s3://bucket/prefix``, ``gs://...``, ...)."""
    if isinstance(path, Location):
        return path if storage_options is None else Location(path.protocol, path.path, dict(storage_options))
    proto, rest = _split_url(os.fspath(path))
    if proto in LOCAL_PROTOCOLS:
        return Location("file", os.path.abspath(os.path.expanduser(rest)))
    opts = dict(storage_options or {})
    loc = Location(proto, rest.rstrip("/"), opts)
    loc.fs  # noqa: B018 - fail early (one line) on an unknown protocol or a missing package
    return loc


def register(con, loc: Location) -> None:
    """Let DuckDB read ``loc``'s filesystem (no-op for local files)."""
    if loc.remote:
        con.register_filesystem(loc.fs)


def is_url(path) -> bool:
    return isinstance(path, str) and "://" in path and _split_url(path)[0] not in LOCAL_PROTOCOLS


__all__ = ["Location", "StorageError", "filesystem", "location", "register", "is_url"]
