"""Directory watches: ``files.watch_dir``, on inotify (through ``ctypes`` on libc).

A ``fs_watch`` request opens the directory the way every files.* request does (from
a workspace root's descriptor, never re-resolving a checked name: see ``_files.py``)
and watches *that descriptor's* directory, through ``/proc/self/fd/N``; a symlink
swapped in afterwards changes nothing. It answers ``watching``, then streams one
``fs_event`` {event, name} per change until the host sends ``fs_watch_stop``, then
``exit``.

Bounds, per sandbox: at most :data:`STREAMS` watches at once and :data:`DIRECTORIES`
directories watched in all (a recursive watch adds one per subdirectory, including
those made later; one past the cap is reported as an ``overflow`` event and not
watched). Queued events are the kernel's (bounded by ``fs.inotify.max_queued_events``;
an overflow there is an ``overflow`` event too), never this process's: each event is
sent as it is read. The sandbox's inotify quota (``fs.inotify.max_user_instances`` /
``max_user_watches``) running out is a ``WatchLimitError``, not a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import select
import struct
import threading
from typing import Any, Dict, List, Optional, Protocol, Tuple

from sandlot.runner._files import DIR_FLAGS, Files, FilesError, _open_dir, _open_entry

STREAMS = 16
"""Watches one sandbox may have at once."""
STOP_WAIT = 5.0
"""Seconds ``fs_watch_stop`` waits for the watch to release its inotify instance (so a
watch started right after the reply finds the slot and the quota free)."""
DIRECTORIES = 1024
"""Directories one sandbox may watch in all (each an inotify watch and a descriptor)."""

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
HEADER = struct.Struct("iIII")
"""struct inotify_event: wd, mask, cookie, len (then ``len`` bytes of name)."""

# (mask bit, event): what a change is called, as fsnotify (and so E2B) names it. A
# rename is "rename" for the old name and "create" for the new one.
KINDS: Tuple[Tuple[int, str], ...] = (
    (IN_CREATE, "create"),
    (IN_MOVED_TO, "create"),
    (IN_MODIFY, "write"),
    (IN_DELETE, "remove"),
    (IN_MOVED_FROM, "rename"),
    (IN_ATTRIB, "chmod"),
)


SETTLE_READS = 16
"""Reads of queued events (64 KiB each) a files operation forwards itself, at most."""


class Host(Protocol):
    """What this module needs of the supervisor."""

    files: Files

    def send(self, message: Dict[str, Any]) -> None: ...

    def reply(self, rid: str, value: Any = None) -> None: ...

    def fail(self, rid: str, name: str, message: str) -> None: ...


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.add = libc.inotify_add_watch
        self.add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.remove = libc.inotify_rm_watch
        self.remove.argtypes = [ctypes.c_int, ctypes.c_int]


_libc: Optional[_Libc] = None


def _lib() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


class QuotaError(Exception):
    """The inotify quota (or this sandbox's cap) is used up."""


class Watch:
    """One watch request: an inotify instance and the directories it watches."""

    def __init__(
        self, table: "Watches", rid: str, recursive: bool, shown: str = "", entries: bool = False
    ) -> None:
        """``shown``: the watched directory's path; ``entries``: each event carries what
        its name is now (``include_entry``)."""
        self.table = table
        self.rid = rid
        self.recursive = recursive
        self.shown = shown
        self.entries = entries
        fd = _lib().init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            if code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise QuotaError(
                    "no inotify instance left for this sandbox (fs.inotify.max_user_instances"
                    " on the host, or open descriptors): stop a watch first"
                )
            raise OSError(code, os.strerror(code))
        self.fd = fd
        self.stop_r, self.stop_w = os.pipe2(os.O_CLOEXEC)
        self.dirs: Dict[int, Tuple[int, str]] = {}
        """wd -> (descriptor of the directory, its path relative to the watched one)."""
        self.released = threading.Event()
        """Set once the watch has closed its descriptors and left the table."""
        self.reading = threading.Lock()
        """Held while events are read and forwarded: by this watch's thread, or by
        :meth:`settle` on the thread of a files operation."""
        self.ended = False

    def add(self, dir_fd: int, relative: str) -> None:
        """Watch the directory open as ``dir_fd`` (taken over: closed with the watch)."""
        if not self.table.take():
            os.close(dir_fd)
            raise QuotaError("this sandbox already watches %d directories, its limit" % DIRECTORIES)
        wd = _lib().add(self.fd, ("/proc/self/fd/%d" % dir_fd).encode(), MASK)
        if wd < 0:
            code = ctypes.get_errno()
            os.close(dir_fd)
            self.table.give()
            if code == errno.ENOSPC:
                raise QuotaError(
                    "no inotify watch left for this sandbox (fs.inotify.max_user_watches"
                    " on the host): stop a watch first"
                )
            raise OSError(code, os.strerror(code))
        old = self.dirs.pop(wd, None)
        if old is not None:  # the same directory again (a hard link cannot; a race can)
            os.close(old[0])
            self.table.give()
        self.dirs[wd] = (dir_fd, relative)

    def add_tree(self, dir_fd: int, relative: str, strict: bool) -> None:
        """Watch the directory and, if recursive, every directory below it."""
        self.add(dir_fd, relative)
        if not self.recursive:
            return
        todo: List[Tuple[int, str]] = [(dir_fd, relative)]
        while todo:
            parent, where = todo.pop()
            for name in sorted(os.listdir(parent)):
                try:
                    sub = _open_entry(parent, name, DIR_FLAGS)
                except OSError:
                    continue  # not a directory (or a link to one: not followed), or gone
                path = posixpath.join(where, name) if where else name
                try:
                    self.add(sub, path)
                except QuotaError:
                    if strict:
                        raise
                    self.table.host.send(_event(self.rid, "overflow", path))
                    return
                todo.append((sub, path))

    def run(self) -> None:
        try:
            while self._pump():
                pass
        except Exception as exc:  # never leave the host without an end
            with contextlib.suppress(Exception):
                self.table.host.send(_event(self.rid, "overflow", repr(exc)))
        finally:
            self.close()
            self.table.done(self)
            self.released.set()
            self.table.host.send({"type": "exit", "id": self.rid, "status": "ok"})

    def _pump(self) -> bool:
        """Forward one batch of events; False once the watch ends."""
        # poll(), not select(): with a thousand directories watched, descriptors are
        # past select()'s 1024.
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self.stop_r, select.POLLIN)
        if any(fd == self.stop_r for fd, _ in poller.poll()):
            return False
        with self.reading:
            return self._forward() is not False

    def settle(self) -> None:
        """Forward every event queued so far, now, on the calling thread: what a files
        operation just did is then reported (and a new subdirectory of a recursive
        watch watched) before the operation answers."""
        with self.reading:
            for _ in range(SETTLE_READS):  # what is left goes out from the watch's thread
                if self.ended:  # closed, or ending: nothing to read, and no stop to send
                    return
                forwarded = self._forward()
                if forwarded is None:
                    return
                if not forwarded:
                    self.stop()  # its thread sees the stop and ends the watch
                    return

    def _forward(self) -> Optional[bool]:
        """Read and forward one batch of what is queued: None if nothing was, False once
        the watch ends. Called with :attr:`reading` held."""
        if self.ended:
            return False
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return None
        if not self._handle(data):
            self.ended = True
            return False
        return True

    def _handle(self, data: bytes) -> bool:
        """Forward the events in ``data``; False once the watch ends."""
        last: Optional[Tuple[str, str]] = None
        offset = 0
        while offset + HEADER.size <= len(data):
            wd, mask, _, size = HEADER.unpack_from(data, offset)
            raw = data[offset + HEADER.size : offset + HEADER.size + size]
            offset += HEADER.size + size
            name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if mask & IN_Q_OVERFLOW:
                self.table.host.send(_event(self.rid, "overflow", ""))
                last = None
                continue
            if mask & IN_IGNORED:
                entry = self.dirs.pop(wd, None)
                if entry is not None:
                    os.close(entry[0])
                    self.table.give()
                if not self.dirs:
                    return False  # the watched directory is gone
                continue
            place = self.dirs.get(wd)
            if place is None or not name:
                if place is not None and place[1] == "" and mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                    return False  # the watched directory itself was removed or moved
                continue
            dir_fd, where = place
            path = posixpath.join(where, name) if where else name
            if mask & IN_ISDIR and mask & IN_MOVED_FROM:
                self._forget(path)
            if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                # Watched before the event goes out: whoever sees it may write into it.
                self._descend(dir_fd, name, path)
            for bit, kind in KINDS:
                if mask & bit and last != (kind, path):  # coalesce repeats in a batch
                    event = _event(self.rid, kind, path)
                    if self.entries and kind not in ("remove", "rename"):
                        found = self._entry(dir_fd, name, path)
                        if found is not None:
                            event["entry"] = found
                    self.table.host.send(event)
                    last = (kind, path)
        return True

    def _entry(self, dir_fd: int, name: str, path: str) -> Optional[Dict[str, Any]]:
        """What ``name`` in the watched ``dir_fd`` is now (as fs_stat says), from the
        directory's descriptor; None once it is gone (best effort, as the event is)."""
        try:
            return self.table.host.files.entry(dir_fd, name, posixpath.join(self.shown, path))
        except (OSError, FilesError):
            return None

    def _descend(self, dir_fd: int, name: str, path: str) -> None:
        """Watch the new subdirectory ``name`` of ``dir_fd`` and what is already in it."""
        try:
            sub = _open_entry(dir_fd, name, DIR_FLAGS)
        except OSError:
            return  # gone already, or a link swapped in: not followed
        try:
            self.add_tree(sub, path, strict=False)
        except QuotaError:
            self.table.host.send(_event(self.rid, "overflow", path))

    def _forget(self, path: str) -> None:
        """Stop watching ``path`` and below (moved away: its names are not ours now)."""
        for wd, (_, where) in list(self.dirs.items()):
            if where == path or where.startswith(path + "/"):
                _lib().remove(self.fd, wd)  # IN_IGNORED follows and closes it

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.stop_w, b"x")

    def close(self) -> None:
        with self.reading:  # not while settle() reads: its descriptors are closed here
            self.ended = True
            self._close()

    def _close(self) -> None:
        for dir_fd, _ in self.dirs.values():
            os.close(dir_fd)
            self.table.give()
        self.dirs.clear()
        for fd in (self.fd, self.stop_r, self.stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Watches:
    """The watches of one sandbox."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.lock = threading.Lock()
        self.streams: Dict[str, Optional[Watch]] = {}
        """Request id -> its watch (None while it starts: counted against the cap)."""
        self.directories = 0

    def take(self) -> bool:
        with self.lock:
            if self.directories >= DIRECTORIES:
                return False
            self.directories += 1
            return True

    def give(self) -> None:
        with self.lock:
            self.directories -= 1

    def done(self, watch: Watch) -> None:
        with self.lock:
            self.streams.pop(watch.rid, None)

    def settle(self) -> None:
        """Forward every watch's queued events now (:meth:`Watch.settle`): called after
        each files operation that changes something, before it answers."""
        with self.lock:
            live = [watch for watch in self.streams.values() if watch is not None]
        for watch in live:
            watch.settle()

    def start(self, request: Dict[str, Any]) -> None:
        rid = request["id"]
        recursive = request.get("recursive") is True
        with self.host.files.locate(request["path"], follow=True) as place:
            dir_fd = _open_dir(place)
            shown = place.shown
        with self.lock:
            full = len(self.streams) >= STREAMS
            if not full:
                self.streams[rid] = None
        if full:
            os.close(dir_fd)
            self.host.fail(
                rid,
                "WatchLimitError",
                "this sandbox already has %d directory watches, its limit; stop one first"
                % STREAMS,
            )
            return
        try:
            watch = Watch(self, rid, recursive, shown, request.get("include_entry") is True)
        except BaseException as exc:
            os.close(dir_fd)
            self._refused(rid, exc)
            return
        try:
            watch.add_tree(dir_fd, "", strict=True)
        except BaseException as exc:
            watch.close()
            self._refused(rid, exc)
            return
        with self.lock:
            self.streams[rid] = watch
        self.host.send({"type": "watching", "id": rid})
        threading.Thread(target=watch.run, daemon=True).start()

    def _refused(self, rid: str, exc: BaseException) -> None:
        with self.lock:
            self.streams.pop(rid, None)
        if not isinstance(exc, QuotaError):
            raise exc
        self.host.fail(rid, "WatchLimitError", str(exc))

    def stop(self, request: Dict[str, Any]) -> None:
        with self.lock:
            watch = self.streams.get(request["target"])
        if watch is not None:
            watch.stop()
            watch.released.wait(STOP_WAIT)
        self.host.reply(request["id"], watch is not None)


def _event(rid: str, kind: str, name: str) -> Dict[str, Any]:
    return {"type": "fs_event", "id": rid, "event": kind, "name": name}
