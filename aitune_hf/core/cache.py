"""The persistent tuning cache: decisions (JSON) and backend artifacts (ONNX models) that outlive the process.

Layout under the cache root (a local folder or an fsspec URL), one entry per key::

    aitune_hf-cache.json                      marker: {"format": FORMAT}
    entries/<key>/decision.json               a backend won: the decision, the candidates' figures, the key's fields
    entries/<key>/negative.json               eager was kept (nothing faster, every candidate failed): the same,
                                              with an expiry
    entries/<key>/<backend>-<weights>/        an artifact: files + manifest.json (each file's size and sha256)
    tmp/                                      staging; moved into place by a rename (local) or a move (fsspec)
    locks/<key>.lock                          a file lock around writes (local folders)

What an entry's key holds is `core/keys.py`'s business (`key_fields` names each part and its owner): the module's
class, structure and plain state, the call, the candidates and the thresholds, the versions, the device. An artifact
that bakes weights sits in a folder named by the weights' digest (`keys.weights_digest`): a LoRA fused into them,
`load_state_dict` or any edit gives another digest, so it is never loaded for other weights.

A negative result never poisons the cache: an eager decision goes to `negative.json`, apart from the positive one. It
is written only where no positive decision is, is removed when one is written, is ignored once a positive one is
there, and expires after `NEGATIVE_TTL_S` (then the module is tuned again). A decision cut short by the tuning budget,
and a tuning that raised, are not kept at all.

A cache folder that cannot be written (a read-only file system, a volume mounted read-only, no permission) is read
and never written: one warning says so, and tuning goes on as usual.

Safety: records are JSON (never unpickled) and checked field by field; an artifact's files are checked against
their manifest's sizes and digests before they are used; anything that fails is ignored with a warning (and, in
"rw" mode, replaced by what this process tunes). Writes go to `tmp/` and are moved into place, under a file
lock. A local root is created 0700, and one that others may write to is refused (its ONNX models would be run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aitune_hf.backends.base import ArtifactPlace, Backend
from aitune_hf.core.keys import key_of, weights_digest
from aitune_hf.core.signature import InputSignature
from aitune_hf.errors import ReadOnlyError

if TYPE_CHECKING:
    from aitune_hf.core.config import TuningConfig

logger = logging.getLogger(__name__)

#: The layout and record format; a record of another format is ignored (and replaced in "rw" mode).
FORMAT = 2
ENV = "AITUNE_HF_CACHE"
MARKER = "aitune_hf-cache.json"
DECISION = "decision.json"
NEGATIVE = "negative.json"
#: How long an eager decision is reused before the module is tuned again (a week).
NEGATIVE_TTL_S = 7 * 24 * 3600
MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20


def default_location() -> str:
    """`aitune_hf` under the user's cache folder (`~/.cache/aitune_hf` on Linux)."""
    import platformdirs

    return platformdirs.user_cache_dir("aitune_hf", appauthor=False)


def open_cache(config: TuningConfig) -> tuple[TuningCache | None, str | None]:
    """The cache `config` asks for (`cache_dir`, else `$AITUNE_HF_CACHE`, else `default_location()`), or None when
    it is off; and why it is not used when it cannot be (a folder others may write to, a URL whose file system is not
    installed: the fsspec package to install is named), else None. That is a warning, never an error: tuning goes on
    without the cache."""
    if config.cache == "off":
        return None, None
    location = config.cache_dir if config.cache_dir is not None else os.environ.get(ENV) or default_location()
    location = os.fspath(location)
    if location.strip().lower() == "off":
        return None, None
    try:
        return TuningCache(location, read_only=config.cache == "ro"), None
    except CacheUnusable as error:
        logger.warning("aitune_hf cache off: %s", error)
        return None, str(error)


class CacheUnusable(Exception):
    """The cache location cannot be used safely (the message says why)."""


@dataclass
class CacheStats:
    """What the cache did for one registration (shown in its report)."""

    location: str
    mode: str
    hits: int = 0  # decisions reused
    misses: int = 0  # decisions tuned afresh (none cached, or the cached one failed its check)
    written: int = 0  # decisions and artifacts written
    artifacts_loaded: int = 0
    problems: list[str] = field(default_factory=list)  # entries ignored, with why
    unwritable: str | None = None  # why a cache opened "rw" is only read (a read-only file system)

    def line(self) -> str:
        parts = [f"cache {self.location} ({self.mode}): {self.hits} decision(s) reused, {self.misses} tuned"]
        if self.artifacts_loaded:
            parts.append(f"{self.artifacts_loaded} artifact(s) loaded")
        parts.append(f"{self.written} written" if self.mode == "rw" else "read-only: nothing written")
        if self.unwritable:
            parts.append(f"not writable: {self.unwritable}")
        if self.problems:
            parts.append(f"{len(self.problems)} entr{'y' if len(self.problems) == 1 else 'ies'} ignored")
        return "; ".join(parts)


@dataclass
class Entry:
    """One cached decision, as `aitune-hf cache ls` shows it."""

    key: str
    record: dict[str, Any] | None  # the positive decision, else the negative one
    artifacts: list[str]
    size_bytes: int
    problem: str | None = None

    @property
    def negative(self) -> bool:
        """True when the entry holds an eager decision (`negative.json`) and no positive one."""
        return self.record is not None and "expires" in self.record

    def describe(self) -> str:
        if self.record is None:
            return f"{self.key}  unreadable: {self.problem}"
        fields, report = self.record.get("fields", {}), self.record.get("report", {})
        chosen = self.record.get("chosen")
        if self.negative:
            expired = " (expired: tuned again at next use)" if _expired(self.record) else ""
            chosen = f"eager, negative until {self.record.get('expires')}{expired}: {report.get('reason')}"
        elif report.get("shared_from"):
            chosen = f"{chosen} (decision shared with {report['shared_from']})"
        text = (
            f"{self.key}  {fields.get('module', '?')}  [{report.get('signature', '?')}]  -> {chosen}"
            f"  ({len(self.artifacts)} artifact(s), {self.size_bytes / 2**20:.1f} MiB)"
        )
        return f"{text}  PROBLEM: {self.problem}" if self.problem else text


class TuningCache:
    """A cache root (local folder or fsspec URL). Thread-safe for the tuning core's use (one tuning at a time)."""

    def __init__(self, location: str, read_only: bool = False) -> None:
        import fsspec

        self.location = location
        self.read_only = read_only
        try:
            self.fs, self.root = fsspec.core.url_to_fs(location)
        except (ImportError, ValueError) as error:
            raise CacheUnusable(f"{location!r}: {error}") from None
        self.local = "file" in _protocols(self.fs) or "local" in _protocols(self.fs)
        unwritable = None
        if self.local:
            self.root = os.path.abspath(self.root)
            self._check_local_root()
            if not read_only:
                unwritable = self._unwritable()
        if unwritable is not None:
            logger.warning(
                "aitune_hf cache %s cannot be written (%s): reading it and writing nothing; tuning goes on", self.root,
                unwritable,
            )  # fmt: skip
            self.read_only = True
        self.stats = CacheStats(location, "ro" if self.read_only else "rw", unwritable=unwritable)

    # -- safety -------------------------------------------------------------------------------------------------
    def _check_local_root(self) -> None:
        root = Path(self.root)
        if not root.exists():
            if self.read_only:
                return  # nothing to read; nothing is created
            try:
                root.mkdir(mode=0o700, parents=True)
            except OSError as error:
                raise CacheUnusable(f"cannot create {root}: {error}") from None
        for folder in [root, *[p for p in (root / "entries", root / "tmp") if p.exists()]]:
            mode = folder.stat().st_mode
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise CacheUnusable(
                    f"{folder} may be written by other users (mode {stat.filemode(mode)}); its ONNX models would run "
                    "in this process. Use a folder only you can write (chmod 700), or a fleet URL"
                )

    def _unwritable(self) -> str | None:
        """Why this local root cannot be written (a read-only file system, no permission), or None: its staging
        folder is created and a file written and removed there, as a tuning would."""
        try:
            staging = Path(self.root) / "tmp"
            staging.mkdir(mode=0o700, exist_ok=True)
            handle, probe = tempfile.mkstemp(dir=staging, prefix=".probe-")
            os.close(handle)
            os.unlink(probe)
        except OSError as error:
            return error.strerror or str(error)
        return None

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    # -- decisions ----------------------------------------------------------------------------------------------
    def read_decision(self, key: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """The positive record for `key`, else its negative one while it has not expired; each only when it is
        whole, of this format and made for exactly `fields`; else None (a warning says why when a record is there
        but unusable)."""
        record = self._read(key, DECISION, fields)
        if record is None:
            record = self._read(key, NEGATIVE, fields)
            if record is not None and _expired(record):
                return None  # tuned again; what that tuning decides replaces it
        return record

    def _read(self, key: str, name: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        path = self._path("entries", key, name)
        try:
            with self.fs.open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            return None
        except OSError as error:
            self._problem(key, f"cannot read {path}: {error}")
            return None
        problem, record = _parse_record(raw, key, fields)
        if problem is not None:
            self._problem(key, problem)
            return None
        return record

    def write_decision(self, key: str, record: dict[str, Any]) -> None:
        """Write `record` as the entry's decision: a positive one (a backend won) replaces the negative one; a negative
        one (eager kept) is written, with its expiry, only where no positive one is."""
        if self.read_only:
            return
        negative = record.get("chosen") == "eager"
        if negative:
            expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=NEGATIVE_TTL_S)
            record = {**record, "expires": expires.isoformat(timespec="seconds")}
        data = json.dumps({"format": FORMAT, "key": key, **record}, indent=1, sort_keys=True, default=str).encode()
        positive, apart = self._path("entries", key, DECISION), self._path("entries", key, NEGATIVE)
        with self._lock(key):
            if negative and self.fs.exists(positive):
                return  # a negative result never replaces a positive one
            self._publish_bytes(apart if negative else positive, data)
            if not negative and self.fs.exists(apart):
                self.fs.rm(apart)  # nor outlives one
        self.stats.written += 1

    # -- artifacts ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A local folder for builds to write artifacts into (removed afterwards). Inside the root for a local
        cache, so that publishing is a rename."""
        if self.local and not self.read_only:
            base = Path(self.root) / "tmp"
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="stage-", dir=base))
        else:
            folder = Path(tempfile.mkdtemp(prefix="aitune_hf_stage_"))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def artifact(self, key: str, name: str, into: Path) -> Path | None:
        """The local folder holding artifact `name` of entry `key`, after checking every file against its
        manifest; None when it is missing or fails the check (a warning says why). A remote artifact is
        downloaded into `into` first."""
        remote = self._path("entries", key, name)
        try:
            with self.fs.open(f"{remote}/{MANIFEST}", "rb") as handle:
                manifest = json.loads(handle.read())
            files = manifest["files"]
            if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
                raise ValueError("not a manifest of this format")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._problem(key, f"artifact {name}: unreadable manifest ({error})")
            return None
        if self.local:
            folder = Path(remote)
        else:
            folder = into / name
            folder.mkdir(parents=True, exist_ok=True)
            try:
                for file in files:
                    self.fs.get(f"{remote}/{file}", str(folder / _plain_name(file)))
            except (OSError, ValueError) as error:
                self._problem(key, f"artifact {name}: download failed ({error})")
                return None
        for file, expected in files.items():
            path = folder / _plain_name(file)
            if (
                not path.is_file()
                or path.stat().st_size != expected.get("size")
                or _sha256(path) != expected.get("sha256")
            ):
                self._problem(key, f"artifact {name}: {file} is missing, truncated or changed")
                return None
        self.stats.artifacts_loaded += 1
        return folder

    def write_artifact(self, key: str, name: str, folder: Path) -> None:
        """Publish the files of `folder` as artifact `name` of entry `key`, with a manifest; replaces an older
        artifact of the same name."""
        if self.read_only:
            return
        files = sorted(p for p in folder.iterdir() if p.is_file())
        described = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        manifest = {"format": FORMAT, "files": described}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        target = self._path("entries", key, name)
        with self._lock(key):
            if self.local:
                Path(target).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                staged = Path(self.root) / "tmp" / f"artifact-{uuid.uuid4().hex}"
                try:  # the build's folder sits in this root's tmp/ (one file system): moved, not copied
                    os.rename(folder, staged)
                except OSError:
                    shutil.copytree(folder, staged)
                old = None
                if Path(target).exists():
                    old = Path(self.root) / "tmp" / f"old-{uuid.uuid4().hex}"
                    os.rename(target, old)
                os.rename(staged, target)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            else:
                staged = self._path("tmp", f"artifact-{uuid.uuid4().hex}")
                self.fs.put(str(folder), staged, recursive=True)
                if self.fs.exists(target):
                    self.fs.rm(target, recursive=True)
                self.fs.mv(staged, target, recursive=True)
        self.stats.written += 1

    # -- listing (aitune-hf cache ls | verify | clear) ------------------------------------------------------------
    def entries(self, verify: bool = False) -> list[Entry]:
        """Every entry; with `verify`, each artifact is checked against its manifest."""
        base = self._path("entries")
        try:
            keys = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        except FileNotFoundError:
            return []
        found = []
        for key in keys:
            folder = self._path("entries", key)
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False)]
            size = sum(self.fs.du(self._path("entries", key, n)) for n in names)
            artifacts = sorted(n for n in names if n not in (DECISION, NEGATIVE))
            record_name = DECISION if DECISION in names else NEGATIVE
            try:
                with self.fs.open(self._path("entries", key, record_name), "rb") as handle:
                    raw = handle.read()
            except (FileNotFoundError, IsADirectoryError):
                found.append(Entry(key, None, artifacts, size, f"no {DECISION} or {NEGATIVE}"))
                continue
            problem, record = _parse_record(raw, key, None)
            entry = Entry(key, record, artifacts, size, problem)
            if verify and problem is None:
                with tempfile.TemporaryDirectory() as scratch:
                    before = len(self.stats.problems)
                    for name in artifacts:
                        self.artifact(key, name, Path(scratch))
                    if len(self.stats.problems) > before:
                        entry.problem = "; ".join(self.stats.problems[before:])
            found.append(entry)
        return found

    def clear(self) -> int:
        """Remove every entry and staging leftover; returns how many entries there were."""
        if self.read_only:
            raise ReadOnlyError(f"cache {self.location} is read-only")
        count = len(self.entries())
        for sub in ("entries", "tmp", "locks"):
            path = self._path(sub)
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        return count

    # -- internals ----------------------------------------------------------------------------------------------
    def _problem(self, key: str, problem: str) -> None:
        self.stats.problems.append(f"{key}: {problem}")
        logger.warning("aitune_hf cache: ignoring entry %s (%s); it is tuned again%s", key, problem,
                       "" if self.read_only else " and replaced")  # fmt: skip

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        """A file lock around writes of one entry (local roots; an fsspec store relies on atomic moves)."""
        if not self.local:
            yield
            return
        from filelock import FileLock

        locks = Path(self.root) / "locks"
        locks.mkdir(mode=0o700, parents=True, exist_ok=True)
        with FileLock(str(locks / f"{key}.lock"), timeout=600):
            yield

    def _publish_bytes(self, path: str, data: bytes) -> None:
        """Write `data` to `path` atomically: a temporary file, then a rename (or an fsspec move)."""
        if self.local:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=Path(path).parent, prefix=".tmp-")
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            return
        temporary = self._path("tmp", f"{uuid.uuid4().hex}.json")
        self.fs.makedirs(self._path("tmp"), exist_ok=True)
        with self.fs.open(temporary, "wb") as out:
            out.write(data)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.mv(temporary, path)


def _expired(record: dict[str, Any]) -> bool:
    """True for a negative record whose expiry has passed (or cannot be read)."""
    try:
        expires = datetime.datetime.fromisoformat(str(record.get("expires")))
    except ValueError:
        return True
    return expires <= datetime.datetime.now(datetime.timezone.utc)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _plain_name(name: str) -> str:
    """A manifest's file name, refused when it could point outside the artifact's folder."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"bad file name in manifest: {name!r}")
    return name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _parse_record(raw: bytes, key: str, fields: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    """(problem, record): JSON only, with the fields this version writes; `fields` must match when given."""
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"not valid JSON (corrupt or truncated: {error})", None
    if not isinstance(record, dict):
        return "not a record", None
    if record.get("format") != FORMAT:
        return f"written in format {record.get('format')!r}, this aitune_hf reads {FORMAT}", record
    missing = [name for name in ("key", "fields", "chosen", "report") if name not in record]
    if missing:
        return f"lacks {', '.join(missing)}", record
    if record["key"] != key:
        return f"holds key {record['key']!r}, found under {key!r}", record
    if fields is not None and record["fields"] != json.loads(json.dumps(fields, default=str)):
        changed = sorted(k for k in {*fields, *record["fields"]} if record["fields"].get(k) != fields.get(k))
        return f"made for other {', '.join(changed)}", record
    return None, record


def report_to_record(report: Any) -> dict[str, Any]:
    """A SignatureReport as JSON-ready data (figures only)."""
    return json.loads(json.dumps(dataclasses.asdict(report), default=str))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- one tuning's use of the cache ----------------------------------------------------------------------------------


class _EntryPlace(ArtifactPlace):
    """The artifacts of one cache entry, as the builds of one tuning see them."""

    def __init__(self, cache: TuningCache, key: str, module: torch.nn.Module, staging: Path) -> None:
        self.cache, self.key, self.module, self.staging = cache, key, module, staging
        self.saved: dict[Path, str] = {}  # folder written by a build -> its artifact name

    @functools.cached_property
    def weights(self) -> str:
        return weights_digest(self.module)

    def name(self, backend: Backend, bakes_weights: bool) -> str:
        label = "".join(c if c.isalnum() or c in "-_" else "_" for c in backend.describe())
        return f"{label}-{self.weights if bakes_weights else 'live'}"

    def load(self, backend: Backend, bakes_weights: bool) -> Path | None:
        scratch = Path(tempfile.mkdtemp(dir=self.staging))
        return self.cache.artifact(self.key, self.name(backend, bakes_weights), scratch)

    def save(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self.staging))


@dataclass
class Consultation:
    """The cache entry for one tuning: its key and fields, the record found (None: none usable), and the place
    where the builds read and write artifacts."""

    cache: TuningCache
    key: str
    fields: dict[str, Any]
    record: dict[str, Any] | None
    place: _EntryPlace

    def store(
        self,
        decision: Any,
        signatures: Sequence[InputSignature],
        new_decision: bool,
        owner: Any = None,
        write_record: bool = True,
    ) -> None:
        """Write `decision` (when `new_decision`, and `write_record`: not for a first plan whose search goes on) and the
        artifact its build wrote (when it built one).

        `owner`: the identical sibling's decision that `decision` reuses (`Sourcing._shared`), else None. Siblings
        that differ only in plain values (a layer index) have keys of their own, and the artifact this sibling
        built (its own weights) goes under its key; so does the shared decision, where this entry holds no positive
        one, so that the entry is whole (`aitune-hf cache verify`) and a later process that meets this module first,
        or alone, reuses it from its own entry. A shared eager decision writes nothing: this module was not tuned,
        and a negative entry is only ever the record of a tuning that found nothing better."""
        cache = self.cache
        if cache.read_only:
            return
        try:
            built = decision.built
            staged = built is not None and not built.loaded and built.artifacts
            if staged and built.artifacts[0].parent == self.place.staging:
                if built.write_artifacts is not None:
                    built.write_artifacts()
                    built.write_artifacts = None  # written once, whoever stores it next
                name = self.place.name(decision.backend, built.bakes_weights)
                cache.write_artifact(self.key, name, built.artifacts[0])
            reports = [decision.report] + ([owner.report] if owner is not None else [])
            cut = [c.backend for r in reports for c in r.candidates if c.skipped_for == "budget"]
            shared = owner is not None and decision.report.shared_from is not None and decision.backend is not None
            if shared and self.record is not None and self.record.get("chosen") != "eager":
                shared = False  # this entry's own positive decision stays
            # A decision cut short by the budget (this one, or the owner's it shares) is no decision for later
            # processes.
            if (new_decision or shared) and not cut and write_record:
                record = {
                    "fields": self.fields,
                    "chosen": decision.report.chosen,
                    "backend": decision.backend.describe() if decision.backend is not None else None,
                    "report": report_to_record(decision.report),
                    "signatures": [signature.short() for signature in signatures],
                    "created": now(),
                }
                cache.write_decision(self.key, record)
        except Exception as error:  # the cache never breaks tuning
            cache.stats.problems.append(f"{self.key}: could not write ({error})")
            logger.warning("aitune_hf cache: could not write entry %s: %s", self.key, error, exc_info=True)


@contextlib.contextmanager
def consult(
    cache: TuningCache | None, module: torch.nn.Module, fields_of: Callable[[], dict[str, Any]]
) -> Iterator[Consultation | None]:
    """The entry for tuning `module` whose key holds `fields_of()` (`keys.key_fields`), or None without a cache; its
    artifacts are staged for the duration of the block."""
    if cache is None:
        yield None
        return
    try:
        fields = fields_of()
        key = key_of(fields)
        record = cache.read_decision(key, fields)
    except Exception as error:  # the cache never breaks tuning
        cache.stats.problems.append(f"lookup failed ({error})")
        logger.warning("aitune_hf cache: lookup failed: %s", error, exc_info=True)
        yield None
        return
    with cache.staging() as staging:
        yield Consultation(cache, key, fields, record, _EntryPlace(cache, key, module, staging))
