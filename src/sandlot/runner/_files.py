"""The files API inside the sandbox: ``files.*`` requests, confined to the workspace.

The supervisor runs these for the host. It can read what user code cannot (its own
``/proc/1/*`` files, above all the host channel's socket), so every operation is
confined to the workspace roots (the working directory and /tmp).

User code runs at the same time and can swap any directory of the workspace for a
symlink at any moment (``renameat2(RENAME_EXCHANGE)`` does it atomically), so a path
is never checked and then used by name: the roots are opened once, every lookup walks
from a root's descriptor, and every operation acts on the descriptor of the directory
the walk arrived at (``dir_fd=``, never following the last name unless it was just
resolved). Where the kernel has ``openat2`` (Linux 5.6), a path without symlinks is
opened in one call with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS``; anything else (a symlink, an older kernel, a filter that
refuses the call) takes the walk, one ``O_NOFOLLOW | O_DIRECTORY`` ``openat`` per name,
which reads each symlink itself and follows it only while it stays inside the roots.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import posixpath
import stat
from typing import Any, Dict, List, Optional, Tuple

from sandlot.protocol import (
    METADATA_KEY_MAX,
    METADATA_TOTAL_MAX,
    METADATA_XATTR_PREFIX,
    NAME_MAX,
    PATH_MAX,
    metadata_problem,
)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How the walk opens a directory: never through a symlink (ENOTDIR or ELOOP then)."""
MAX_SYMLINKS = 40
"""Symlinks one lookup may follow, as the kernel allows."""


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


class MetadataRefused(FilesError):
    """Metadata the file's filesystem cannot keep (no user extended attributes, or no
    room for them): the write fails rather than drop it."""


class Place:
    """Where a lookup arrived: the open directory ``fd`` and ``name`` in it, or the
    directory itself when ``name`` is empty; ``shown`` is its path, for replies and
    messages only (never opened again). The caller closes it."""

    __slots__ = ("fd", "name", "shown")

    def __init__(self, fd: int, name: str, shown: str) -> None:
        self.fd = fd
        self.name = name
        self.shown = shown

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Place":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Files:
    """The ``files.*`` operations, relative to the working directory ``workdir``."""

    # A path must name something in the roots, and a symlink is followed only while
    # what it leads to is there too (absolute links and links between the two roots
    # included). Writes never go through a symlink as the file itself.
    def __init__(self, workdir: str, roots: Optional[Tuple[str, ...]] = None) -> None:
        """``roots``: the workspace, ``workdir`` and /tmp unless given (tests give others)."""
        self.workdir = workdir
        self.roots: Tuple[str, ...] = roots or (workdir, "/tmp")
        # Opened once, before any user code runs. Their parents (/, /home) are not
        # writable by user code and each root is a mount of its own, so these
        # descriptors are the workspace for the sandbox's life.
        self.root_fds: Dict[str, int] = {}
        self.root_errors: Dict[str, str] = {}
        for root in self.roots:
            try:
                self.root_fds[root] = os.open(root, DIR_FLAGS)
            except OSError as exc:
                self.root_errors[root] = str(exc.strerror or exc)

    def close(self) -> None:
        for fd in self.root_fds.values():
            os.close(fd)
        self.root_fds.clear()

    def confined(self, path: str) -> str:
        """The absolute, normalised path, or PathRefused when it is outside the roots."""
        _check_name(path)
        lexical = os.path.normpath(os.path.join(self.workdir, path))
        if lexical.startswith("//"):  # normpath keeps a leading "//"
            lexical = "/" + lexical.lstrip("/")
        if not _within(lexical, self.roots):
            raise PathRefused(
                "%s is outside the sandbox workspace (%s)" % (lexical, ", ".join(self.roots))
            )
        return lexical

    # --- lookups --------------------------------------------------------------------
    def locate(self, path: str, follow: bool, create: bool = False) -> Place:
        """Where ``path`` leads, from a root's descriptor. ``follow``: a symlink as the
        last name is followed (reads, lists), else the link itself is the place (stat,
        remove, rename, write). ``create``: missing directories on the way are made."""
        lexical = self.confined(path)
        fast = self._beneath(lexical)
        if fast is not None:
            if not follow or not fast.name:
                return fast
            try:
                last = os.stat(fast.name, dir_fd=fast.fd, follow_symlinks=False)
            except OSError:
                return fast  # missing: the operation itself says so
            if not stat.S_ISLNK(last.st_mode):
                return fast
            fast.close()
        return self._walk(lexical, follow, create)

    def _root_fd(self, root: str) -> int:
        """A descriptor of ``root`` the caller owns (a duplicate of the one kept)."""
        fd = self.root_fds.get(root)
        if fd is None:
            raise FilesError(
                "the workspace directory %s could not be opened when the sandbox started "
                "(%s)" % (root, self.root_errors.get(root, "unknown error"))
            )
        return os.dup(fd)

    def _beneath(self, lexical: str) -> Optional[Place]:
        """The fast path: the directory of ``lexical`` in one openat2 call, refused by the
        kernel on any symlink, magic link or way out; None when it cannot say (then the
        walk does, and gives the precise answer or error)."""
        root = next(r for r in self.roots if _within(lexical, (r,)))
        if lexical == root:
            return Place(self._root_fd(root), "", root)
        directory, name = posixpath.split(lexical[len(root) + 1 :])
        fd = _openat2_beneath(self.root_fds.get(root), directory or ".")
        return None if fd is None else Place(fd, name, lexical)

    def _walk(self, path: str, follow: bool, create: bool) -> Place:
        """Resolve the absolute ``path`` one name at a time, each opened with
        O_NOFOLLOW relative to the directory before it, reading symlinks here."""
        stack: List[Tuple[int, str]] = []  # (descriptor, path): a root, then below it
        todo: List[str] = []  # the names still to resolve, the next one last
        links = 0
        created = ""  # the directory just made, to make each one once only
        try:
            self._enter(path, path, stack, todo)
            while todo:
                name = todo.pop()
                if name in ("", "."):
                    continue
                fd, where = stack[-1]
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop()[0])
                    else:  # above a root: what is left is an absolute path again
                        above = posixpath.dirname(where)
                        self._enter(path, "/".join([above, *reversed(todo)]), stack, todo)
                    continue
                shown = posixpath.join(where, name)
                if not todo:  # the last name
                    if not follow:
                        return _take(stack, name, shown)
                    try:
                        last = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        return _take(stack, name, shown)  # the operation reports it
                    if not stat.S_ISLNK(last.st_mode):
                        return _take(stack, name, shown)
                    target = _read_link(fd, name, shown, errno.ELOOP)
                else:
                    try:
                        stack.append((_open_entry(fd, name, DIR_FLAGS), shown))
                        continue
                    except OSError as exc:
                        if exc.errno == errno.ENOENT and create and created != shown:
                            created = shown
                            try:
                                os.mkdir(name, 0o777, dir_fd=fd)
                            except FileExistsError:
                                pass  # made meanwhile (or a link): look again
                            except OSError as err:
                                raise OSError(err.errno, err.strerror, shown) from None
                            todo.append(name)
                            continue
                        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                            raise OSError(exc.errno, exc.strerror, shown) from None
                        target = _read_link(fd, name, shown, exc.errno)
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                if target.startswith("/"):
                    self._enter(path, "/".join([target, *reversed(todo)]), stack, todo)
                else:
                    todo.extend(reversed(target.split("/")))
            # Ended on a directory itself (a link to "." or "..", or a root).
            fd, where = stack.pop()
            return _take(stack, "", where, fd)
        except BaseException:
            for fd, _ in stack:
                os.close(fd)
            raise

    def _enter(
        self, path: str, absolute: str, stack: List[Tuple[int, str]], todo: List[str]
    ) -> None:
        """Start again from the absolute path ``absolute``: lexically down to a root (its
        ancestors, / and /home, are read-only in every backend, so hold no symlinks of
        user code's; and whatever they held, a path only goes on from a root's
        descriptor), then from that root's descriptor. PathRefused if it leads anywhere
        else."""
        for fd, _ in stack:
            os.close(fd)
        del stack[:]
        parts = absolute.split("/")
        cursor = "/"
        for index, part in enumerate(parts):
            if part in ("", "."):
                continue
            cursor = posixpath.dirname(cursor) if part == ".." else posixpath.join(cursor, part)
            if cursor in self.roots:
                stack.append((self._root_fd(cursor), cursor))
                todo[:] = reversed(parts[index + 1 :])
                return
            if not any(root.startswith(cursor.rstrip("/") + "/") for root in self.roots):
                break
        raise PathRefused(
            "%s leads outside the sandbox workspace (%s) through a symlink (to %s)"
            % (path, ", ".join(self.roots), "/" + posixpath.normpath(absolute).lstrip("/"))
        )

    def _is_dir_inside(self, path: str) -> bool:
        """Whether ``path`` (a symlink's) leads to a directory inside the roots."""
        try:
            with self.locate(path, follow=True) as place:
                if not place.name:
                    return True
                mode = os.stat(place.name, dir_fd=place.fd, follow_symlinks=False).st_mode
                return stat.S_ISDIR(mode)
        except (OSError, FilesError):
            return False

    # --- operations -----------------------------------------------------------------
    def open_read(self, path: str) -> Tuple[int, str]:
        with self.locate(path, follow=True) as place:
            if not place.name:
                raise IsADirectoryError(errno.EISDIR, "%s is a directory" % place.shown)
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = _open_entry(place.fd, place.name, flags)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a link swapped in since the lookup
                    raise PathRefused("%s changed while it was opened" % place.shown) from None
                raise OSError(exc.errno, exc.strerror, place.shown) from None
            target = place.shown
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise IsADirectoryError(errno.EISDIR, "%s is %s" % (target, what))
        os.set_blocking(fd, True)
        return fd, target

    def open_write(self, path: str, append: bool) -> Tuple[int, int, str]:
        """(directory fd, file fd, path) for writing; never through a symlink."""
        if self.confined(path) in self.roots:
            raise IsADirectoryError(errno.EISDIR, "%s is a directory" % self.confined(path))
        place = self.locate(path, follow=False, create=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_APPEND if append else os.O_TRUNC
        try:
            fd = _open_entry(place.fd, place.name, flags, 0o666)
        except OSError as exc:
            place.close()
            if exc.errno == errno.ELOOP:
                raise PathRefused(
                    "%s is a symlink; files.write does not write through symlinks" % place.shown
                ) from None
            if exc.errno == errno.ENXIO:
                raise PathRefused("%s is not a regular file" % place.shown) from None
            raise OSError(exc.errno, exc.strerror, place.shown) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            place.close()
            raise PathRefused("%s is not a regular file" % place.shown)
        if not append:
            # The file is the sandbox user's anyway; saying so again is what E2B's envd
            # does on every upload, so a directory watcher sees the same events there
            # and here (a new file: create, chmod, write). Not ours: left as it is.
            with contextlib.suppress(OSError):
                os.fchown(fd, os.getuid(), os.getgid())
        os.set_blocking(fd, True)
        return place.fd, fd, place.shown

    def entry(self, dir_fd: int, name: str, shown: str) -> Dict[str, Any]:
        """What ``name`` in ``dir_fd`` is (the directory itself when ``name`` is empty),
        without following it; it is shown as ``shown``."""
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if name else os.fstat(dir_fd)
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        target = None
        if stat.S_ISLNK(info.st_mode):
            target = os.readlink(name, dir_fd=dir_fd)
            # A link's type is what it points at, but only inside the workspace: outside,
            # the files API does not even say whether something exists.
            if self._is_dir_inside(shown):
                kind = "dir"
        found: Dict[str, Any] = {
            "name": posixpath.basename(shown) or shown,
            "type": kind,
            "path": shown,
            "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode),
            "permissions": stat.filemode(info.st_mode),
            "modified_time": info.st_mtime,
            "symlink_target": target,
        }
        if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
            # By the directory's descriptor (its /proc/self/fd link), never by the
            # name's path: the name itself is not followed.
            metadata = read_metadata("/proc/self/fd/%d/%s" % (dir_fd, name) if name else dir_fd)
            if metadata:
                found["metadata"] = metadata
        return found

    def write(
        self,
        path: str,
        data: bytes,
        append: bool,
        limit: Optional[int],
        metadata: Optional[Dict[str, str]] = None,
    ) -> Dict[str, Any]:
        """Write (or append) ``data``. A write that is not an append also replaces the
        file's metadata with ``metadata`` (none: the file keeps none, as a new file)."""
        if metadata is not None:
            problem = metadata_problem(metadata)
            if problem is not None:
                raise InvalidArgument(problem)
        dir_fd, fd, shown = self.open_write(path, append)
        try:
            size = os.fstat(fd).st_size if append else 0
            try:
                if limit is not None and size + len(data) > limit:
                    # The host checks this too; an upload over the limit leaves no
                    # partial file.
                    raise InvalidArgument(
                        "%s: upload larger than the limit of %d bytes" % (shown, limit)
                    )
                if not append:
                    _replace_metadata(fd, metadata or {}, shown)
            except (FilesError, OSError):
                # Truncated already: a write that cannot store its metadata leaves no
                # file rather than one without (or with stale) metadata.
                with contextlib.suppress(OSError):
                    os.unlink(posixpath.basename(shown), dir_fd=dir_fd)
                raise
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            stored = read_metadata(fd)
        finally:
            os.close(fd)
            os.close(dir_fd)
        written: Dict[str, Any] = {"name": posixpath.basename(shown), "type": "file", "path": shown}
        if stored:
            written["metadata"] = stored
        return written

    def list(self, path: str, depth: int) -> List[Dict[str, Any]]:
        depth = max(1, depth)
        with self.locate(path, follow=True) as place:
            top = _open_dir(place)
        entries: List[Dict[str, Any]] = []

        def walk(dir_fd: int, directory: str, level: int) -> None:
            for name in sorted(os.listdir(dir_fd)):
                full = posixpath.join(directory, name)
                try:
                    item = self.entry(dir_fd, name, full)
                except OSError:
                    continue  # gone meanwhile
                entries.append(item)
                if level < depth and item["type"] == "dir" and item["symlink_target"] is None:
                    try:
                        sub = _open_entry(dir_fd, name, DIR_FLAGS)
                    except OSError:
                        continue  # gone, or swapped for a link: not listed below
                    try:
                        walk(sub, full, level + 1)
                    finally:
                        os.close(sub)

        try:
            walk(top, place.shown, 1)
        finally:
            os.close(top)
        return entries

    def stat(self, path: str) -> Dict[str, Any]:
        with self.locate(path, follow=False) as place:
            try:
                return self.entry(place.fd, place.name, place.shown)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, place.shown) from None

    def remove(self, name: str) -> None:
        if self.confined(name) in self.roots:
            raise PathRefused("%s is a workspace root and cannot be removed" % self.confined(name))
        with self.locate(name, follow=False) as place:
            try:
                info = os.stat(place.name, dir_fd=place.fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    _remove_tree(place.fd, place.name)
                else:
                    os.unlink(place.name, dir_fd=place.fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, place.shown) from None

    def make_dir(self, name: str) -> bool:
        if self.confined(name) in self.roots:
            return False
        with self.locate(name, follow=False, create=True) as place:
            try:
                os.mkdir(place.name, 0o777, dir_fd=place.fd)
                return True
            except FileExistsError:
                pass
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, place.shown) from None
            info = os.stat(place.name, dir_fd=place.fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                return False
            if stat.S_ISLNK(info.st_mode):
                # A link to a directory is one, if it stays inside (else PathRefused).
                with self.locate(place.shown, follow=True) as target:
                    if not target.name or stat.S_ISDIR(
                        os.stat(target.name, dir_fd=target.fd, follow_symlinks=False).st_mode
                    ):
                        return False
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), place.shown)

    def rename(self, source: str, destination: str) -> Dict[str, Any]:
        if self.confined(source) in self.roots or self.confined(destination) in self.roots:
            raise PathRefused("a workspace root cannot be renamed or replaced")
        src = self.locate(source, follow=False)
        with src, self.locate(destination, follow=False, create=True) as dst:
            try:
                os.rename(src.name, dst.name, src_dir_fd=src.fd, dst_dir_fd=dst.fd)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, src.shown) from None
            return self.entry(dst.fd, dst.name, dst.shown)


def read_metadata(target: Any) -> Optional[Dict[str, str]]:
    """The metadata of ``target`` (a descriptor, or a path whose last name is not
    followed), None if it has none or its filesystem keeps no attributes. What does not
    fit the limits (set by other means than files.write) is left out, not cut."""
    try:
        if isinstance(target, int):
            names = os.listxattr(target)
        else:
            names = os.listxattr(target, follow_symlinks=False)
    except OSError:
        return None
    found: Dict[str, str] = {}
    total = 0
    for attribute in sorted(names):
        key = attribute[len(METADATA_XATTR_PREFIX) :]
        if not attribute.startswith(METADATA_XATTR_PREFIX) or not key:
            continue
        if len(key.encode("utf-8", "surrogateescape")) > METADATA_KEY_MAX:
            continue
        try:
            if isinstance(target, int):
                raw = os.getxattr(target, attribute)
            else:
                raw = os.getxattr(target, attribute, follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile
        size = len(attribute.encode("utf-8", "surrogateescape")) + len(raw)
        if total + size > METADATA_TOTAL_MAX:
            continue
        total += size
        found[key] = raw.decode("utf-8", "replace")
    return found or None


def _replace_metadata(fd: int, metadata: Dict[str, str], shown: str) -> None:
    """Make ``metadata`` the metadata of the open file ``fd``: stale keys go first."""
    try:
        names = os.listxattr(fd)
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            raise OSError(exc.errno, exc.strerror, shown) from None
        names = []  # a filesystem without attributes holds no stale metadata
    for attribute in names:
        if attribute.startswith(METADATA_XATTR_PREFIX):
            try:
                os.removexattr(fd, attribute)
            except OSError as exc:
                if exc.errno != errno.ENODATA:  # ENODATA: removed meanwhile
                    raise OSError(exc.errno, exc.strerror, shown) from None
    for key, value in metadata.items():
        try:
            os.setxattr(fd, METADATA_XATTR_PREFIX + key, value.encode("ascii"))
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                raise MetadataRefused(
                    "%s: file metadata is kept in user extended attributes (user.*), which "
                    "this filesystem does not support (tmpfs has them from Linux 6.6 on; "
                    "this sandbox runs %s): write without metadata, or run sandlot on a "
                    "newer kernel" % (shown, platform.release())
                ) from None
            if exc.errno in (errno.ENOSPC, errno.E2BIG, errno.EDQUOT):
                raise MetadataRefused(
                    "%s: no room for the file's metadata (%s)" % (shown, exc.strerror)
                ) from None
            raise OSError(exc.errno, exc.strerror, shown) from None


def _take(stack: List[Tuple[int, str]], name: str, shown: str, fd: int = -1) -> Place:
    """The place ``name`` in the directory on top of ``stack`` (or the directory ``fd``
    itself); every other descriptor of the walk is closed."""
    if fd < 0:
        fd = stack.pop()[0]
    for other, _ in stack:
        os.close(other)
    del stack[:]
    return Place(fd, name, shown)


def _open_entry(dir_fd: int, name: str, flags: int, mode: int = 0o777) -> int:
    """``name`` in ``dir_fd`` opened with ``flags`` (which have O_NOFOLLOW), checked to be
    that entry itself: OSError(ELOOP) if the descriptor is anything else. Some kernels
    follow a symlink despite O_NOFOLLOW when O_DIRECTORY is given too (gVisor's), so
    the flag alone is not trusted: a link, or an entry swapped since, is refused."""
    fd = os.open(name, flags, mode, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        entry = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        os.close(fd)
        raise
    if (opened.st_dev, opened.st_ino) != (entry.st_dev, entry.st_ino):
        os.close(fd)
        raise OSError(errno.ELOOP, "a symlink, or replaced while it was opened", name)
    return fd


def _read_link(dir_fd: int, name: str, shown: str, why: int) -> str:
    """The target of the symlink ``name``, which an open refused with ``why`` (ENOTDIR
    or ELOOP); NotADirectoryError if it is a file, PathRefused if it changed."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: not a link
            raise OSError(exc.errno, exc.strerror, shown) from None
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, shown) from None
    if why == errno.ENOTDIR and not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown)
    # A directory again (or a link again): swapped while it was looked up.
    raise PathRefused("%s changed while it was looked up" % shown)


def _open_dir(place: Place) -> int:
    """A descriptor of the directory at ``place``, for listing."""
    if not place.name:
        return os.dup(place.fd)
    try:
        return _open_entry(place.fd, place.name, DIR_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise NotFound("%s does not exist" % place.shown) from None
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise OSError(exc.errno, exc.strerror, place.shown) from None
    try:
        mode = os.stat(place.name, dir_fd=place.fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode) or stat.S_ISDIR(mode):  # a link swapped in since the lookup
        raise PathRefused("%s changed while it was opened" % place.shown)
    raise FilesError("%s is not a directory" % place.shown)


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove the directory ``name`` in ``parent_fd`` and everything in it, by
    descriptor: a directory swapped for a link meanwhile is unlinked, not followed."""
    try:
        fd = _open_entry(parent_fd, name, DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(name, dir_fd=parent_fd)  # not a directory (any more)
        return
    try:
        for child in os.listdir(fd):
            try:
                mode = os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode):
                _remove_tree(fd, child)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


# openat2(2), Linux 5.6: its number is 437 on every architecture listed here.
_OPENAT2 = 437
_OPENAT2_MACHINES = (
    "x86_64",
    "aarch64",
    "arm64",
    "armv7l",
    "armv8l",
    "i386",
    "i686",
    "ppc64le",
    "riscv64",
    "s390x",
    "loongarch64",
)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


class _Openat2:
    """openat2 through libc's syscall(); off for good once the kernel (or a seccomp
    filter) says it has none."""

    def __init__(self) -> None:
        self.syscall: Optional[Any] = None
        if platform.machine() in _OPENAT2_MACHINES:
            try:
                self.syscall = ctypes.CDLL(None, use_errno=True).syscall
                self.syscall.restype = ctypes.c_long
            except (OSError, AttributeError):
                self.syscall = None


_openat2 = _Openat2()


def _openat2_beneath(dir_fd: Optional[int], path: str) -> Optional[int]:
    """``path``, a directory below ``dir_fd``, opened by openat2 with no symlink, magic
    link or ``..`` out allowed anywhere in it; None if that fails for any reason."""
    if _openat2.syscall is None or dir_fd is None:
        return None
    how = _OpenHow(DIR_FLAGS, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = int(
        _openat2.syscall(
            ctypes.c_long(_OPENAT2),
            ctypes.c_long(dir_fd),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd >= 0:
        return fd
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG):
        # No openat2 here (an old kernel, a filter refusing it, flags it does not
        # know): the walk alone from now on.
        _openat2.syscall = None
    return None


def _within(path: str, roots: Tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _check_name(path: str) -> None:
    # The host checks these too; the runner does not rely on it.
    if "\0" in path or not path:
        raise PathRefused("invalid path %r" % path[:100])
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise PathRefused("path too long (at most %d bytes, %d per name)" % (PATH_MAX, NAME_MAX))
