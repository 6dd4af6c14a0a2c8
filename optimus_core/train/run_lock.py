"""The run directory's lock: one training process (one job, however many ranks) at a time.

    with RunLock(run_dir, run_id):      # global rank 0 only; the other ranks of its job never ask
        ...train...                     # the lock's heartbeat is refreshed meanwhile

Contract:

- The lock is ``run_dir/run.lock``, JSON: the holder's ``host`` (socket.gethostname()), ``pid``,
  ``run_id``, the run's ``uid`` where the directory has one (its meta.json's: the run's identity
  wherever it moves), a ``token`` unique to this holding, ``started`` and ``heartbeat`` (Unix seconds;
  ``started_utc`` for people) and ``heartbeat_every_s``. A daemon thread rewrites it
  (atomically) every ``heartbeat_s`` (30 s) while the lock is held (and creates it again if it
  was removed by hand).
- Taking it is atomic against a concurrent taker: it is created with ``O_CREAT | O_EXCL``, and
  the one that creates it holds it. A lock that exists and is *live* refuses, with
  :class:`RunDirBusy` (a FileExistsError: the ``optimus`` command's one-line, exit-1 error) in
  one sentence naming the holder.
- A lock is *stale* when its host is this host and its pid is not alive (the holder was killed
  here), or when its heartbeat is older than ``stale_after_s`` (300 s, ten missed heartbeats: a
  job killed on another host, whose pid this host cannot ask about). A stale lock is taken over
  with a warning naming the old holder. Take-overs are serialised by a second lock,
  ``run.lock.takeover`` (O_EXCL, held for milliseconds, itself stale after 60 s): holding it, the
  taker re-reads the lock, replaces it (rename of a complete file) only if it is still the one it
  judged stale, and re-reads to confirm it holds it; otherwise it starts again, and a fresh lock
  refuses it. A stale lock of another run (another run id, or another uid where both are known)
  is never taken over, nor is a lock that is a link (a run's lock is a file of its own: a link is
  another directory's part): both refuse, naming what they are. A lock whose content cannot be parsed (a taker between its create and its write, or
  one killed there) is judged by the file's age instead.
- Releasing (the ``with`` block's end, normal or not) stops the heartbeat and removes the lock
  if it is still this holding's. A holder whose lock was taken over (it had stopped refreshing
  for ``stale_after_s``: suspended, or a file system that hung) finds out at its next heartbeat:
  it logs an error naming the new holder, stops refreshing, sets ``lost`` and leaves the new
  holder's lock alone.

Limits: heartbeats are compared across hosts, so clocks that disagree by a sizeable fraction of
``stale_after_s`` would misjudge a lock (the limit is generous for that reason). Hosts are told
apart by name: containers that share a hostname and a file system but not a pid namespace
would take each other's live locks for dead ones; give them distinct hostnames. A holder's
heartbeat reads, then rewrites: a take-over landing between the two is overwritten (the taker
judged a live holder stale, which needs a holder silent for ``stale_after_s``).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..atomic import atomic_write, fsync_dir
from ..log import get_logger
from ..provenance import utc_now

_log = get_logger(__name__)

LOCK_NAME = "run.lock"
TAKEOVER_NAME = "run.lock.takeover"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats
TAKEOVER_STALE_S = 60.0  # a take-over takes milliseconds: its lock this old was left by a crash
_ATTEMPTS = 20  # rounds of "find it stale, meet another taker, look again" (about 10 s in all)


class RunDirBusy(FileExistsError):
    """Another live process trains into this run directory. A FileExistsError because the CLI
    reports those as input / environment errors: one line, exit status 1 (not 2: no configuration
    change fixes it, and a later attempt may succeed once the holder has finished)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except (OSError, OverflowError, ValueError):  # not a pid this host can have: not ours to judge
        return True
    try:  # a zombie (killed, not yet reaped by its parent) answers kill(pid, 0) but holds nothing
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # gone since kill(), where there is a /proc; no /proc (macOS): kill's answer
        return not Path("/proc/self").is_dir()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def _read(path: Path) -> tuple[bytes | None, dict | None]:
    """(the raw bytes, the parsed holder) of ``path``; (None, None) when it is absent, and
    (bytes, None) when it cannot be parsed."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw, None
    return raw, holder if isinstance(holder, dict) else None


class RunLock:
    """``run_dir``'s lock for run ``run_id``, held between ``acquire()`` and ``release()`` (or
    the ``with`` block). ``heartbeat_s`` and ``stale_after_s`` are parameters for tests; runs use
    the defaults. After ``acquire``, ``took_over`` is the stale holder it replaced (or None)."""

    def __init__(self, run_dir: str | Path, run_id: str, *, uid: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        if not heartbeat_s > 0 or not stale_after_s > heartbeat_s:
            raise ValueError(f"heartbeat_s = {heartbeat_s}, stale_after_s = {stale_after_s}: need "
                             f"0 < heartbeat_s < stale_after_s")
        self.run_dir, self.run_id, self.uid = Path(run_dir), run_id, uid
        self.path = self.run_dir / LOCK_NAME
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.token = uuid.uuid4().hex
        self.took_over: dict | None = None
        self.lost = False  # another process took the lock over while this one held it
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started, self._started_utc = 0.0, ""
        self._write_lock = threading.Lock()  # the heartbeat and release do not interleave

    # ------------------------------------------------------------------ what the file holds
    def _content(self) -> bytes:
        now = time.time()
        return json.dumps({"host": self.host, "pid": self.pid, "run_id": self.run_id, "uid": self.uid,
                           "token": self.token,
                           "started": self._started, "started_utc": self._started_utc, "heartbeat": now,
                           "heartbeat_every_s": self.heartbeat_s}, indent=2).encode()

    def _mine(self, holder: dict | None) -> bool:
        return bool(holder) and holder.get("token") == self.token

    def _why_stale(self, raw: bytes, holder: dict | None, now: float) -> str | None:
        """Why the lock read as ``raw`` / ``holder`` is stale, or None while it is live."""
        if holder is None:  # unparseable: judged by the file's age
            try:
                age = now - self.path.stat().st_mtime
            except FileNotFoundError:
                return "it is gone"
            return f"it is unreadable and {age:.0f} s old" if age > self.stale_after_s else None
        pid = holder.get("pid")
        if holder.get("host") == self.host and isinstance(pid, int) and pid > 0 and not _pid_alive(pid):
            return f"pid {pid} is no longer running on this host"
        beat = holder.get("heartbeat")
        age = now - beat if isinstance(beat, (int, float)) else float("inf")
        if age > self.stale_after_s:
            return f"its heartbeat is {age:.0f} s old (limit {self.stale_after_s:.0f} s)"
        return None

    def describe(self, holder: dict | None, now: float | None = None) -> str:
        """'pid 1234 on host h (heartbeat 12 s ago, run r)'."""
        if holder is None:
            return "an unknown process (the lock file is being written or was left half-written)"
        beat = holder.get("heartbeat")
        ago = (f"heartbeat {max(0.0, (now or time.time()) - beat):.0f} s ago" if isinstance(beat, (int, float))
               else "no heartbeat")  # (a clock ahead of ours reads as 0 s)
        return f"pid {holder.get('pid')} on host {holder.get('host')} ({ago}, run {holder.get('run_id')})"

    def refusal(self, why: str = "") -> RunDirBusy:
        """The refusal another rank of a job whose rank 0 was refused gives: the same sentence,
        naming the lock's holder as it reads now (``why`` where there is none to name)."""
        raw, holder = _read(self.path)
        if raw is None:
            return RunDirBusy(f"{self.run_dir}: {why or 'the run lock was not taken'}")
        return self._busy(holder)

    def _foreign(self, holder: dict | None) -> str | None:
        """What makes the lock ``holder`` another run's, or None (it is this run's, or unreadable)."""
        if not holder:
            return None
        if holder.get("run_id") not in (None, self.run_id):
            return f"run {holder.get('run_id')!r}"
        if holder.get("uid") and self.uid and holder["uid"] != self.uid:
            return f"another run {self.run_id!r} (uid {holder['uid']}, this one's is {self.uid})"
        return None

    def _busy(self, holder: dict | None) -> RunDirBusy:
        return RunDirBusy(f"{self.run_dir} is being trained by {self.describe(holder)}: wait for it to finish or "
                          f"stop it; a lock whose heartbeat stops is taken over after {self.stale_after_s:.0f} s")

    # ------------------------------------------------------------------ taking and giving back
    def acquire(self) -> "RunLock":
        """Hold the lock, taking over a stale one; RunDirBusy while another process holds it."""
        if self._held:
            raise RuntimeError(f"{self.path}: already held by this RunLock")
        self._started = time.time()
        self._started_utc = utc_now()
        for attempt in range(_ATTEMPTS):
            if self.path.is_symlink():
                raise RunDirBusy(f"{self.path} is a link to {os.readlink(self.path)}: a run's lock is a file of its "
                                 f"own, not another directory's; remove the link (nothing was changed)")
            if self._create():
                break
            raw, holder = _read(self.path)
            if raw is None:  # released between our create and our read: try again
                continue
            why = self._why_stale(raw, holder, time.time())
            if why is None:  # live, this run's or another's: its holder named
                raise self._busy(holder)
            foreign = self._foreign(holder)
            if foreign is not None:
                raise RunDirBusy(f"{self.path} is the lock of {foreign}, not of run {self.run_id!r} in "
                                 f"{self.run_dir} (stale: {why}): this run never takes another run's lock over; "
                                 f"remove it once that run is done (nothing was changed)")
            if self._take_over(raw):
                self.took_over = dict(holder or {}, why=why)
                _log.warning("%s: took over the stale lock of %s (%s)", self.run_dir, self.describe(holder), why)
                break
            time.sleep(0.01 * 2 ** min(attempt, 6))  # another taker is at it: look again (its lock refuses us)
        else:
            raise RunDirBusy(f"{self.run_dir}: could not take the run lock {self.path} in {_ATTEMPTS} attempts "
                             f"(other processes keep taking and releasing it): stop them, then run again")
        self._held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"run-lock-heartbeat:{self.run_dir.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _create(self) -> bool:
        """Create the lock, whole, if there is none (O_EXCL: of two creators one succeeds)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            try:
                os.write(fd, self._content())
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:  # a full disk, say: leave no empty lock to refuse the next run
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            raise
        fsync_dir(self.run_dir)
        return True

    def _take_over(self, stale: bytes) -> bool:
        """Replace the lock that read ``stale`` with ours, if it is still that one; True when we
        hold it afterwards. Serialised with other takers by the take-over lock."""
        guard = self.run_dir / TAKEOVER_NAME
        try:
            fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - guard.stat().st_mtime > TAKEOVER_STALE_S:  # its taker crashed
                    guard.unlink()
            return False
        try:
            try:
                os.write(fd, f"{self.host} {self.pid}\n".encode())
            finally:
                os.close(fd)
            if _read(self.path)[0] != stale:  # refreshed, released or replaced meanwhile
                return False
            self._replace()
        finally:
            with contextlib.suppress(FileNotFoundError):
                guard.unlink()
        return self._mine(_read(self.path)[1])

    def _replace(self) -> None:
        """Write our lock whole under a temporary name and rename it over the lock (never absent,
        never partial): optimus_core.atomic's ``.run.lock.tmp-*``, which a run directory may hold."""
        atomic_write(self.path, self._content())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._write_lock:
                if self._stop.is_set():
                    return
                try:
                    raw, holder = _read(self.path)
                    if raw is None:  # removed by hand: ours again (O_EXCL), unless another process was first
                        if self._create():
                            continue
                        holder = _read(self.path)[1]
                    if not self._mine(holder):
                        self.lost = True
                        _log.error("%s: the run lock was taken over by %s while this process (pid %d) trained "
                                   "into it; two processes may now be writing it: stop one", self.run_dir,
                                   self.describe(holder), self.pid)
                        return
                    self._replace()
                except OSError as e:  # a file system hiccup: the next beat tries again
                    _log.warning("%s: could not refresh the run lock's heartbeat: %s", self.run_dir, e)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (idempotent)."""
        if not self._held:
            return
        self._held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._write_lock:
            if self._mine(_read(self.path)[1]):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                with contextlib.suppress(OSError):
                    fsync_dir(self.run_dir)

    @property
    def held(self) -> bool:
        return self._held

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
