"""What is under a checkpoint root: committed steps, partial folders, damaged commits; and
retention. Reads manifests through ``Storage``; imports no torch, so ``checkflow ls``/``gc``
start fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from checkflow import knobs, manifest_json, validate
from checkflow import manifest as mf
from checkflow.storage import (
    Failure,
    Storage,
    StorageAccessError,
    StorageError,
    classify_error,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Catalog:
    committed: dict[int, mf.GlobalManifest] = field(default_factory=dict)
    """Readable commits, by step, oldest first."""
    folders: list[int] = field(default_factory=list)
    """Every step folder, committed or not."""
    damaged: dict[int, str] = field(default_factory=dict)
    """Steps whose ``MANIFEST.json`` exists but cannot be read: why."""
    foreign: dict[str, str] = field(default_factory=dict)
    """Entries of the root that are not step folders, by name: why. Never read, counted
    or deleted (``ls --all`` shows them): a look-alike such as ``step-0000000099`` or a
    link to another run's step is not this root's checkpoint."""

    @property
    def partial(self) -> list[int]:
        """Folders with no commit marker (in flight, or abandoned)."""
        return [s for s in self.folders if s not in self.committed and s not in self.damaged]


def scan(storage: Storage) -> Catalog:
    cat = Catalog()
    for name in storage.listdir():
        step = mf.parse_step_dir(name)
        if step is None:
            cat.foreign[name] = "not a step folder name"
            continue
        if (why := not_a_folder(storage, name)) is not None:
            cat.foreign[name] = why
            continue
        cat.folders.append(step)
        path = f"{name}/{mf.MANIFEST}"
        try:
            cat.committed[step] = read_global(storage, step, folder=name)
        except FileNotFoundError:
            continue  # not committed: invisible
        except (mf.ManifestError, OSError) as e:
            log.warning("ignoring %s: %s", storage.url(path), e)
            cat.damaged[step] = str(e)
    cat.folders.sort()
    cat.committed = dict(sorted(cat.committed.items()))
    return cat


def not_a_folder(storage: Storage, name: str) -> str | None:
    """Why the root entry ``name`` (a step folder's name) is not a real folder (a link, a
    file), or None when it is one."""
    kind = storage.entry_kind(name)
    if kind not in (None, "folder"):  # None: an object store, whose folders are prefixes
        return f"a {kind}, not a folder"
    return None


def roots_below(storage: Storage, *, limit: int = 100) -> list[str]:
    """Names of the folders directly under the root that hold step folders, sorted.

    Where the checkpoints are when the folder named is a run's work folder, not its root:
    the demo's ``runs/demo`` holds them in ``ckpt/``. Only the first ``limit`` entries are
    looked into, so a large bucket prefix costs at most that many listings.
    """
    found = []
    for name in storage.listdir()[:limit]:
        if mf.parse_step_dir(name) is not None:
            continue
        if any(mf.parse_step_dir(child) is not None for child in storage.listdir(name)):
            found.append(name)
    return found


def read_manifest_bytes(storage: Storage, path: str) -> bytearray:
    """A manifest's bytes. One larger than ``knobs.max_manifest_bytes()`` is refused on its
    stated size, before any byte is read (a sparse file of 512 MiB costs nothing); one that
    grows meanwhile is read to its stated size and one byte more, which ``from_json``
    refuses when that is over the cap (and otherwise fails to parse: damage).

    Raises:
        FileNotFoundError: there is no such file.
        ManifestError: it is larger than the cap.
    """
    cap = knobs.max_manifest_bytes()
    if (size := storage.size(path)) > cap:
        raise mf.ManifestError(f"{storage.url(path)}: {manifest_json.too_large(size, cap)}")
    # Asking for the stated size, not the cap: a read of n bytes allocates n up front.
    return storage.read_at_most(path, size)


def read_global(storage: Storage, step: int, *, folder: str | None = None) -> mf.GlobalManifest:
    """The validated commit of ``step`` (in ``folder``, its canonical name by default).

    Raises:
        FileNotFoundError: the step is not committed.
        ManifestError: the commit is damaged (``validate.DamagedStepError`` says how).
        OSError: it cannot be read.
    """
    path = f"{folder or mf.step_dir(step)}/{mf.MANIFEST}"
    gm = mf.GlobalManifest.from_json(read_manifest_bytes(storage, path), where=storage.url(path))
    validate.check_global(gm, step)
    return gm


def committed_steps(storage: Storage) -> dict[int, mf.GlobalManifest]:
    """Every readable committed checkpoint under the root, by step, oldest first."""
    return scan(storage).committed


def retention_plan(
    steps: dict[int, mf.GlobalManifest],
    all_folders: list[int],
    keep: int,
    damaged: frozenset[int] | set[int] = frozenset(),
) -> tuple[list[int], list[int]]:
    """(steps to keep, step folders to delete) for ``keep`` newest committed checkpoints.

    A base that a kept delta needs is kept, transitively. Folders without a commit are
    deleted only below the newest committed step: above it they may still be in flight.
    ``damaged`` folders (a commit marker that cannot be read) are never deleted: that is
    evidence for a person to look at, not garbage. A kept delta whose chain reaches a base
    that is damaged (or gone) may need any older step through it, whose own bases cannot be
    read: every committed step older than that base is kept too.
    """
    committed = sorted(steps)
    wanted = set(committed[-keep:]) if keep else set(committed)
    todo = list(wanted)
    while todo:  # iterative: a long chain costs no stack
        for base in _bases(steps, todo.pop(), committed):
            if base not in wanted:
                wanted.add(base)
                todo.append(base)
    newest = committed[-1] if committed else -1
    delete = [
        s
        for s in all_folders
        if s not in wanted and s not in damaged and (s in steps or s < newest)
    ]
    return sorted(wanted), sorted(delete)


def _bases(steps: dict[int, mf.GlobalManifest], step: int, committed: list[int]) -> list[int]:
    """The steps that reading ``step`` may need: its bases, and for a base whose commit is
    not readable (its bases unknown), every committed step older than that base."""
    if step not in steps:
        return []  # damaged or gone: what it needs is covered by its readers, above
    bases = list(steps[step].base_steps)
    for b in steps[step].base_steps:
        if b not in steps:
            bases.extend(s for s in committed if s < b)
    return bases


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """What retention keeps and deletes under one root, with the reasons, before any I/O:
    ``checkflow gc`` prints it, :func:`apply_retention` carries it out."""

    keep: list[int]
    """Committed steps kept: the newest ``keep`` and every base they need."""
    needed_bases: list[int]
    """Kept steps beyond the newest ``keep``, kept only because a kept delta reads them."""
    delete: list[int]
    """Step folders to delete, oldest first."""
    uncommitted: list[int]
    """The folders of ``delete`` without a commit marker (abandoned partial writes)."""
    damaged: dict[int, str]
    """Folders left alone although their commit marker is unreadable: why it is."""


def plan_retention(cat: Catalog, keep: int) -> RetentionPlan:
    """The :class:`RetentionPlan` for keeping the ``keep`` newest committed checkpoints."""
    kept, delete = retention_plan(cat.committed, cat.folders, keep, set(cat.damaged))
    newest = set(sorted(cat.committed)[-keep:]) if keep else set(cat.committed)
    return RetentionPlan(
        keep=kept,
        needed_bases=[s for s in kept if s not in newest],
        delete=delete,
        uncommitted=[s for s in delete if s not in cat.committed],
        damaged=dict(cat.damaged),
    )


@dataclass(frozen=True, slots=True)
class DeleteFailure:
    """A step folder retention could not delete, and whether trying again can help."""

    step: int
    reason: str
    """The store's words (or checkflow's one line for an access error)."""
    permanent: bool
    """The store refuses it (access denied, an unsupported request, a read-only endpoint):
    the same delete fails again until the store or the credentials change."""


class RetentionError(Exception):
    """Retention left step folders it should have deleted; the checkpoints stay readable.

    Attributes:
        failures: each step not deleted, with its reason.
    """

    def __init__(self, failures: list[DeleteFailure]) -> None:
        self.failures = failures
        steps = ", ".join(str(f.step) for f in failures)
        super().__init__(f"could not delete step(s) {steps}: {failures[0].reason}")

    @property
    def permanent(self) -> bool:
        """Whether the store refuses the deletes (retrying cannot help)."""
        return any(f.permanent for f in self.failures)


def delete_steps(storage: Storage, steps: list[int]) -> list[DeleteFailure]:
    """Delete these step folders; returns the ones not deleted, and why. After the first
    permanent refusal the rest are not tried: they would be refused the same way."""
    failed: list[DeleteFailure] = []
    for i, step in enumerate(steps):
        try:
            # The commit marker goes first: a half-deleted checkpoint is then invisible.
            storage.delete(f"{mf.step_dir(step)}/{mf.MANIFEST}")
            storage.delete(mf.step_dir(step))
        except (OSError, StorageAccessError) as e:
            # A failed deletion must not fail the checkpoint that triggered it; the caller
            # says it once (the Checkpointer's log and stats, gc's error line).
            permanent = _permanent(e)
            failed.append(DeleteFailure(step, str(e), permanent))
            if permanent:
                failed += [DeleteFailure(s, str(e), True) for s in steps[i + 1 :]]
                break
    return failed


def _permanent(error: BaseException) -> bool:
    # A StorageError is a transient error that outlived its retries: a later run may pass.
    if isinstance(error, StorageAccessError):
        return True
    return not isinstance(error, StorageError) and classify_error(error) is not Failure.TRANSIENT


def apply_retention(storage: Storage, keep: int, *, dry_run: bool = False) -> list[int]:
    """Delete checkpoints beyond the ``keep`` newest committed ones (and abandoned partial
    folders). Returns the deleted steps. Never touches the newest committed checkpoint.

    Raises:
        RetentionError: some folders were not deleted (the others were).
    """
    plan = plan_retention(scan(storage), keep)
    if not dry_run:
        failed = delete_steps(storage, plan.delete)
        if failed:
            raise RetentionError(failed)
    return plan.delete
