"""`BlobLocation`: where batch files live, a local directory or an S3 prefix.

Rules of this module:
- A location is a local path (str or PathLike), `file:///abs/dir`, or `s3://bucket/prefix`
  (S3 through pyarrow's own `S3FileSystem`: credentials from the usual AWS environment,
  options such as `?region=eu-west-1&endpoint_override=host:port` as URI query
  parameters, which `uri` keeps). Any other scheme is refused. `open` checks the location
  is usable (it creates a local directory, then writes and deletes a probe file), so a
  bad location fails at start with a message naming it, never at the first append.
- Batch paths are relative to the location, in one of two shapes: a file
  `<collection id>/<32 hex digits>.parquet`, or a directory `<collection id>/<32 hex
  digits>/` of part files written by Spark (the trailing `/` marks it, in the manifest
  and in every path and URI derived from it). `remove` deletes nothing of another
  shape, so no mistake elsewhere can make storage delete a file that is not a batch.
- The data of a directory batch is its `*.parquet` files whose names start with neither
  `_` nor `.`: Spark's `_SUCCESS`, `_temporary/` and `.crc` files are not data, and
  Spark's own reader skips them too.
- A local write is durable when it returns: the file, and the directories naming it,
  are fsynced (unless fsync is off). An object store's write is durable once its upload
  completes. Reads, listings and removals go through `pyarrow.fs` for every location.
- Spark reads a location through Hadoop: `file:/abs/dir/...` locally, and
  `s3a://bucket/prefix/...` for S3 (Spark's S3A settings are its own to configure).
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from catalog import InvalidArgument

_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")  # two letters at least: not C:/
_HEX = r"[0-9a-f]{32}"
BATCH_PATH = re.compile(rf"u\d+/{_HEX}(?:\.parquet|/)\Z")
DIRECTORY_BATCH_PATH = re.compile(rf"u\d+/{_HEX}/\Z")
_COLLECTION_DIR = re.compile(r"u\d+\Z")
_BATCH_FILE_NAME = re.compile(rf"{_HEX}\.parquet\Z")
_BATCH_DIR_NAME = re.compile(rf"{_HEX}\Z")
_PARQUET_SUFFIX = ".parquet"


def is_hidden(name: str) -> bool:
    """Names Spark and storage skip in a batch directory (`_SUCCESS`, `.x.crc`, ...)."""
    return name.startswith(("_", "."))


@dataclass(frozen=True, slots=True)
class BlobLocation:
    """An opened, usable blob location. `root` is its path on `filesystem`, `local` its
    directory when it is on the local filesystem (None for S3)."""

    uri: str
    filesystem: pafs.FileSystem
    root: str
    spark_root: str
    local: Path | None

    @classmethod
    def open(cls, location: str | os.PathLike[str]) -> BlobLocation:
        """Parse `location` and check it is usable; InvalidArgument naming it if not."""
        location = os.fspath(location)
        match = _URI.match(location)
        scheme = match["scheme"].lower() if match else "file"
        if scheme == "file":
            opened = cls._local(location if match is None else _file_uri_path(location))
        elif scheme == "s3":
            opened = cls._s3(location)
        else:
            raise InvalidArgument(
                f"unsupported blob location {location!r}: the scheme {scheme!r} is not one "
                f"of a local path, file:///abs/dir or s3://bucket/prefix"
            )
        opened._check_writable()
        return opened

    @classmethod
    def _local(cls, path: str) -> BlobLocation:
        directory = Path(path).resolve()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InvalidArgument(
                f"the blob location {directory.as_uri()} is unusable: cannot create the "
                f"directory ({error.strerror or error})"
            ) from None
        root = directory.as_posix()
        return cls(directory.as_uri(), pafs.LocalFileSystem(), root, f"file:{root}", directory)

    @classmethod
    def _s3(cls, location: str) -> BlobLocation:
        parts = urlsplit(location)
        if not parts.netloc:
            raise InvalidArgument(
                f"the blob location {location!r} names no bucket (s3://bucket/prefix)"
            )
        try:
            filesystem, path = pafs.FileSystem.from_uri(location)
        except (OSError, pa.ArrowException) as error:
            raise InvalidArgument(f"the blob location {location!r} is unusable: {error}") from None
        root = path.rstrip("/")
        query = f"?{parts.query}" if parts.query else ""
        return cls(f"s3://{root}{query}", filesystem, root, f"s3a://{root}", None)

    def _check_writable(self) -> None:
        probe = self.fs_path(f".tandem-probe-{uuid.uuid4().hex}")
        try:
            with self.filesystem.open_output_stream(probe) as stream:
                stream.write(b"probe")
            self.filesystem.delete_file(probe)
        except (OSError, pa.ArrowException) as error:
            raise InvalidArgument(
                f"the blob location {self.uri} is unusable: cannot write a file in it ({error})"
            ) from None

    # --- Paths --------------------------------------------------------------------------

    def fs_path(self, relative: str) -> str:
        """`relative` (to the location) as a path on `filesystem`."""
        return f"{self.root}/{_checked_relative(relative)}"

    def spark_uri(self, relative: str) -> str:
        """`relative` (to the location) as the URI Spark's Hadoop filesystem reads."""
        return f"{self.spark_root}/{_checked_relative(relative)}"

    # --- Files --------------------------------------------------------------------------

    def write_file(self, relative: str, table: pa.Table, *, fsync: bool) -> int:
        """Write `table` as the new Parquet file `relative`; returns its size in bytes."""
        if self.local is None:
            with self.filesystem.open_output_stream(self.fs_path(relative)) as stream:
                pq.write_table(table, stream)
                return stream.tell()
        path = self.local / relative
        if not path.parent.is_dir():
            path.parent.mkdir(exist_ok=True)
            if fsync:
                sync_directory(self.local)
        with open(path, "xb") as file:
            pq.write_table(table, file)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
        if fsync:
            sync_directory(path.parent)
        return path.stat().st_size

    def sync_batch_directory(self, relative: str, files: list[str]) -> None:
        """Make a local directory batch written by another process (Spark) durable: its
        data `files`, the directory and the collection's directory. Nothing to do on an
        object store."""
        if self.local is None:
            return
        for path in files:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        directory = self.local / relative
        sync_directory(directory)
        sync_directory(directory.parent)

    def directory_entries(self, path: str) -> list[pafs.FileInfo]:
        """The entries of directory `path` (a path on `filesystem`) that are not hidden
        (`is_hidden`), sorted by name; none if it does not exist."""
        selector = pafs.FileSelector(path.rstrip("/"), allow_not_found=True)
        entries = self.filesystem.get_file_info(selector)
        return sorted((e for e in entries if not is_hidden(e.base_name)), key=lambda e: e.base_name)

    def batch_files(self, path: str) -> list[str]:
        """The Parquet files holding the batch at `path` (a path on `filesystem`, ending
        in `/` for a directory batch): the file itself, or the directory's data files."""
        if not path.endswith("/"):
            return [path]
        return [
            e.path
            for e in self.directory_entries(path)
            if e.type == pafs.FileType.File and e.base_name.endswith(_PARQUET_SUFFIX)
        ]

    def read_batch(self, path: str, schema: pa.Schema) -> pa.Table:
        """The rows of the batch at `path` (a path on `filesystem`), in `schema`."""
        tables = [
            pq.read_table(file, schema=schema, filesystem=self.filesystem)
            for file in self.batch_files(path)
        ]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def remove(self, relative: str) -> None:
        """Delete batch `relative` (a file, or a directory with everything in it), if it is
        still there. Refuses any path that is not batch-shaped."""
        if not BATCH_PATH.match(relative):
            raise InvalidArgument(f"{relative!r} is not a batch path; storage deletes only batches")
        path = self.fs_path(relative).rstrip("/")
        try:
            if relative.endswith("/"):
                self.filesystem.delete_dir(path)
            else:
                self.filesystem.delete_file(path)
        except FileNotFoundError:
            pass  # removed already: removal is idempotent

    def batch_paths(self) -> list[str]:
        """The relative path of every batch-shaped file and directory in the location."""
        found = []
        for top in self.directory_entries(self.root):
            if top.type != pafs.FileType.Directory or not _COLLECTION_DIR.match(top.base_name):
                continue
            for entry in self.directory_entries(top.path):
                name = entry.base_name
                if entry.type == pafs.FileType.File and _BATCH_FILE_NAME.match(name):
                    found.append(f"{top.base_name}/{name}")
                elif entry.type == pafs.FileType.Directory and _BATCH_DIR_NAME.match(name):
                    found.append(f"{top.base_name}/{name}/")
        return found

    def modified_ns(self, relative: str) -> int | None:
        """When batch `relative` last changed (ns since the epoch): a file's mtime; for a
        directory the latest of its own and of everything in it, since a writer may be
        adding files deep inside it. None if it is gone."""
        path = self.fs_path(relative).rstrip("/")
        info = self.filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return None
        times = [info.mtime_ns]
        if info.type == pafs.FileType.Directory:
            selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
            times += [e.mtime_ns for e in self.filesystem.get_file_info(selector)]
        known = [t for t in times if t is not None]  # object stores have no directory times
        return max(known) if known else None


def sync_directory(directory: Path) -> None:
    """Make the entries of `directory` durable (a new file's name, not only its data)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _file_uri_path(location: str) -> str:
    parts = urlsplit(location)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise InvalidArgument(
            f"unsupported blob location {location!r}: a file URI names a local absolute "
            f"directory, file:///abs/dir"
        )
    return unquote(parts.path)


def _checked_relative(relative: str) -> str:
    parts = relative.split("/")
    if not relative or relative.startswith("/") or ".." in parts or "\\" in relative:
        raise InvalidArgument(f"{relative!r} is not a path relative to the blob location")
    return relative
