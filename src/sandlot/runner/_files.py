"""The files API inside the sandbox: ``files.*`` requests, confined to the workspace.

The supervisor runs these for the host. It can read what user code cannot (its own
``/proc/1/*`` files, above all the host channel's socket), so every operation is
confined to the workspace roots (the working directory and /tmp).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import Any, Dict, List, Optional, Tuple

from sandlot.protocol import NAME_MAX, PATH_MAX


class FilesError(Exception):
    """A files.* request that failed; ``name`` is the error the host raises."""

    name = "FileOperationError"


class PathRefused(FilesError):
    """A files.* path outside the workspace, or reaching outside through a symlink."""

    name = "PathNotAllowedError"


class NotFound(FilesError):
    name = "NotFoundError"


class InvalidArgument(FilesError):
    name = "InvalidArgumentError"


class Files:
    """The ``files.*`` operations, relative to the working directory ``workdir``."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    # The files API is confined to the workspace roots (the working directory and /tmp):
    # a path must name something there, and a symlink is followed only when what it
    # resolves to is there too. Writes never go through a symlink. Every open is checked
    # again on the descriptor itself (/proc/self/fd), so a link swapped in between the
    # check and the open (user code runs concurrently) is caught too. This matters
    # because the supervisor can read what user code cannot: its own /proc/1/* files.
    def resolve(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.workdir, path))

    @property
    def roots(self) -> Tuple[str, ...]:
        return (self.workdir, "/tmp")

    def confined(self, path: str) -> str:
        """The absolute, normalised path, or PathRefused when it is outside the roots."""
        _check_name(path)
        lexical = self.resolve(path)
        if lexical.startswith("//"):  # normpath keeps a leading "//"
            lexical = "/" + lexical.lstrip("/")
        if not _within(lexical, self.roots):
            raise PathRefused(
                "%s is outside the sandbox workspace (%s)" % (lexical, ", ".join(self.roots))
            )
        return lexical

    def with_real_parent(self, path: str) -> str:
        """The path with its directory's symlinks resolved; the last part is kept as is
        (stat, remove and rename act on a link itself). Refused outside the roots."""
        lexical = self.confined(path)
        if lexical in self.roots:
            return lexical
        parent = os.path.realpath(os.path.dirname(lexical))
        if not _within(parent, self.roots):
            raise PathRefused(
                "%s resolves outside the sandbox workspace (to %s) through a symlink"
                % (lexical, parent)
            )
        return os.path.join(parent, os.path.basename(lexical))

    def real(self, path: str) -> str:
        """The path with every symlink resolved; refused when that leaves the roots."""
        lexical = self.confined(path)
        target = os.path.realpath(lexical)
        if not _within(target, self.roots):
            raise PathRefused(
                "%s is a symlink (or under one) to %s, outside the sandbox workspace"
                % (lexical, target)
            )
        return target

    def check_fd(self, fd: int, shown: str) -> None:
        """Refuse (and close) a descriptor whose file is not where the checks said."""
        try:
            actual = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            actual = ""  # cannot tell: fail closed
        if not _within(actual, self.roots):
            os.close(fd)
            raise PathRefused("%s changed to point outside the sandbox workspace" % shown)

    def open_read(self, path: str) -> Tuple[int, str]:
        target = self.real(path)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathRefused("%s changed while it was opened" % target) from None
            raise
        self.check_fd(fd, target)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise IsADirectoryError(errno.EISDIR, "%s is %s" % (target, what))
        os.set_blocking(fd, True)
        return fd, target

    def open_write(self, path: str, append: bool) -> Tuple[int, int, str]:
        """(directory fd, file fd, path) for writing; never through a symlink."""
        target = self.with_real_parent(path)
        if target in self.roots:
            raise IsADirectoryError(errno.EISDIR, "%s is a directory" % target)
        parent, name = os.path.split(target)
        os.makedirs(parent, exist_ok=True)
        dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.check_fd(dir_fd, parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_APPEND if append else os.O_TRUNC
        try:
            fd = os.open(name, flags, 0o666, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            if exc.errno == errno.ELOOP:
                raise PathRefused(
                    "%s is a symlink; files.write does not write through symlinks" % target
                ) from None
            if exc.errno == errno.ENXIO:
                raise PathRefused("%s is not a regular file" % target) from None
            raise OSError(exc.errno, exc.strerror, target) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            os.close(dir_fd)
            raise PathRefused("%s is not a regular file" % target)
        os.set_blocking(fd, True)
        return dir_fd, fd, target

    def entry(self, path: str) -> Dict[str, Any]:
        info = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        target = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
        # A link's type is what it points at, but only inside the workspace: outside,
        # the files API does not even say whether something exists.
        if (
            target is not None
            and _within(os.path.realpath(path), self.roots)
            and os.path.isdir(path)
        ):
            kind = "dir"
        return {
            "name": os.path.basename(path) or path,
            "type": kind,
            "path": path,
            "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode),
            "permissions": stat.filemode(info.st_mode),
            "modified_time": info.st_mtime,
            "symlink_target": target,
        }

    def write(self, path: str, data: bytes, append: bool, limit: Optional[int]) -> Dict[str, Any]:
        dir_fd, fd, shown = self.open_write(path, append)
        try:
            size = os.fstat(fd).st_size if append else 0
            if limit is not None and size + len(data) > limit:
                # The host checks this too; an upload over the limit leaves no partial file.
                with contextlib.suppress(OSError):
                    os.unlink(os.path.basename(shown), dir_fd=dir_fd)
                raise InvalidArgument(
                    "%s: upload larger than the limit of %d bytes" % (shown, limit)
                )
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
            os.close(dir_fd)
        return {"name": os.path.basename(shown), "type": "file", "path": shown}

    def list(self, path: str, depth: int) -> List[Dict[str, Any]]:
        root = self.real(path)
        depth = max(1, depth)
        if not os.path.isdir(root):
            if os.path.lexists(root):
                raise FilesError("%s is not a directory" % root)
            raise NotFound("%s does not exist" % root)
        entries: List[Dict[str, Any]] = []

        def walk(directory: str, level: int) -> None:
            for name in sorted(os.listdir(directory)):
                full = os.path.join(directory, name)
                try:
                    item = self.entry(full)
                except OSError:
                    continue
                entries.append(item)
                if level < depth and item["type"] == "dir" and not os.path.islink(full):
                    walk(full, level + 1)

        walk(root, 1)
        return entries

    def stat(self, path: str) -> Dict[str, Any]:
        return self.entry(self.with_real_parent(path))

    def remove(self, name: str) -> None:
        path = self.with_real_parent(name)
        if path in self.roots:
            raise PathRefused("%s is a workspace root and cannot be removed" % path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def make_dir(self, name: str) -> bool:
        path = self.with_real_parent(name)
        if os.path.isdir(path):
            return False
        os.makedirs(path)
        return True

    def rename(self, source: str, destination: str) -> Dict[str, Any]:
        src = self.with_real_parent(source)
        dst = self.with_real_parent(destination)
        if src in self.roots or dst in self.roots:
            raise PathRefused("a workspace root cannot be renamed or replaced")
        parent = os.path.dirname(dst)
        if parent:
            os.makedirs(parent, exist_ok=True)
        os.rename(src, dst)
        return self.entry(dst)


def _within(path: str, roots: Tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _check_name(path: str) -> None:
    # The host checks these too; the runner does not rely on it.
    if "\0" in path or not path:
        raise PathRefused("invalid path %r" % path[:100])
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise PathRefused("path too long (at most %d bytes, %d per name)" % (PATH_MAX, NAME_MAX))
