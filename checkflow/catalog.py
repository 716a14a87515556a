"""What is under a checkpoint root: committed steps, partial folders, damaged commits; and
retention. Reads manifests through ``Storage``; imports no torch, so ``checkflow ls``/``gc``
start fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from checkflow import knobs, manifest_json, validate
from checkflow import manifest as mf
from checkflow import timeline as tl
from checkflow.lineage import read_lineage
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
    lineage: tl.Lineage = field(default_factory=tl.Lineage)
    """The current timeline and its chain (``checkflow.timeline``): ``committed``,
    ``folders`` and ``damaged`` hold its steps only."""
    names: dict[int, str] = field(default_factory=dict)
    """The folder name of each step of ``folders``."""
    abandoned: dict[str, str] = field(default_factory=dict)
    """Step folders of other timelines (rolled back), by name: ``committed``, ``partial``
    or ``damaged``. Never restored; gc deletes all but the damaged ones."""

    @property
    def partial(self) -> list[int]:
        """Folders with no commit marker (in flight, or abandoned)."""
        return [s for s in self.folders if s not in self.committed and s not in self.damaged]


def scan(storage: Storage) -> Catalog:
    """What is under the root: the current lineage's steps, the abandoned ones, and the
    foreign entries (``TIMELINE-*.json`` files are the root's own: ``checkflow.timeline``)."""
    names = storage.listdir()
    folders, foreign = _step_folders(storage, names)
    cat = Catalog(lineage=read_lineage(storage, names), foreign=foreign)
    on, off = cat.lineage.pick(folders)
    for step, f in on.items():
        cat.folders.append(step)
        cat.names[step] = folders[f]
        state = _commit_state(storage, step, folders[f], cat.committed)
        if state not in ("committed", "partial"):
            cat.damaged[step] = state
    for f in off:
        state = _commit_state(storage, f.step, folders[f], {})
        cat.abandoned[folders[f]] = state if state in ("committed", "partial") else "damaged"
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


def _step_folders(
    storage: Storage, names: list[str]
) -> tuple[dict[mf.StepFolder, str], dict[str, str]]:
    """The real step folders among the root entries ``names``, and the foreign entries."""
    folders: dict[mf.StepFolder, str] = {}
    foreign: dict[str, str] = {}
    for name in names:
        folder = mf.parse_step_dir(name)
        if folder is None:
            if tl.parse_timeline_file(name) is None:
                foreign[name] = "not a step folder name"
        elif (why := not_a_folder(storage, name)) is not None:
            foreign[name] = why
        else:
            folders[folder] = name
    return folders, foreign


def _commit_state(
    storage: Storage, step: int, name: str, into: dict[int, mf.GlobalManifest]
) -> str:
    """``committed`` (its manifest added to ``into``), ``partial``, or why it is damaged."""
    path = f"{name}/{mf.MANIFEST}"
    try:
        into[step] = read_global(storage, step, folder=name)
        return "committed"
    except FileNotFoundError:
        return "partial"  # not committed: invisible
    except (mf.ManifestError, OSError) as e:
        log.warning("ignoring %s: %s", storage.url(path), e)
        return str(e)


def lineage_names(storage: Storage) -> tuple[tl.Lineage, dict[int, str]]:
    """The current lineage and ``{step: folder name}`` of its step folders, committed or not
    (one listing and the TIMELINE files; no manifest is read)."""
    names = storage.listdir()
    folders, _ = _step_folders(storage, names)
    lineage = read_lineage(storage, names)
    on, _ = lineage.pick(folders)
    return lineage, {s: folders[f] for s, f in on.items()}


def marked_after(storage: Storage, step: int | None) -> tuple[tl.Lineage, list[int]]:
    """The current lineage and its steps after ``step`` (all when None) whose
    ``MANIFEST.json`` exists, readable or not; no manifest is read."""
    lineage, names = lineage_names(storage)
    newer = [s for s, n in names.items() if step is None or s > step]
    return lineage, [s for s in newer if storage.exists(f"{names[s]}/{mf.MANIFEST}")]


class LineageFolders:
    """``folders(step)``: the folder of ``step`` on the root's current lineage, listed once
    at the first call (one listing and the TIMELINE files; no manifest is read)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._names: dict[int, str] | None = None

    def __call__(self, step: int) -> str:
        if self._names is None:
            self._names = lineage_names(self.storage)[1]
        return self._names.get(step) or mf.step_dir(step)


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
    """Folders left alone although their commit marker is unreadable: why."""
    abandoned: list[str] = field(default_factory=list)
    """Folders of rolled-back timelines to delete (no kept step reads them: the bases of
    the lineage's steps are on the lineage); damaged ones stay, as above."""
    held: str = ""
    """The TIMELINE files that cannot be used, when nothing is deleted because of them."""


def plan_retention(cat: Catalog, keep: int) -> RetentionPlan:
    """The :class:`RetentionPlan` for keeping the ``keep`` newest committed checkpoints.
    Nothing is deleted while a TIMELINE file is ignored: which steps are the run's is unsure
    (its own may be behind the damaged file), and a damaged root is evidence, not garbage."""
    if cat.lineage.ignored:
        held = ", ".join(tl.timeline_file(k) for k in sorted(cat.lineage.ignored))
        return RetentionPlan(sorted(cat.committed), [], [], [], dict(cat.damaged), held=held)
    kept, delete = retention_plan(cat.committed, cat.folders, keep, set(cat.damaged))
    newest = set(sorted(cat.committed)[-keep:]) if keep else set(cat.committed)
    return RetentionPlan(
        keep=kept,
        needed_bases=[s for s in kept if s not in newest],
        delete=delete,
        uncommitted=[s for s in delete if s not in cat.committed],
        damaged=dict(cat.damaged),
        abandoned=sorted(name for name, state in cat.abandoned.items() if state != "damaged")
        if keep
        else [],
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


def delete_steps(
    storage: Storage, steps: list[int], names: dict[int, str] | None = None
) -> list[DeleteFailure]:
    """Delete these step folders (named by ``names``, the catalog's; by default the
    timeline-0 names); returns the ones not deleted, and why."""
    names = names or {}
    return delete_folders(storage, [(s, names.get(s) or mf.step_dir(s)) for s in steps])


def delete_folders(storage: Storage, folders: list[tuple[int, str]]) -> list[DeleteFailure]:
    """Delete these ``(step, folder name)``; returns the ones not deleted, and why. After
    the first permanent refusal the rest are not tried: they would be refused the same way."""
    failed: list[DeleteFailure] = []
    for i, (step, name) in enumerate(folders):
        try:
            # The commit marker goes first: a half-deleted checkpoint is then invisible.
            storage.delete(f"{name}/{mf.MANIFEST}")
            storage.delete(name)
        except (OSError, StorageAccessError) as e:
            # A failed deletion must not fail the checkpoint that triggered it; the caller
            # says it once (the Checkpointer's log and stats, gc's error line).
            permanent = _permanent(e)
            failed.append(DeleteFailure(step, str(e), permanent))
            if permanent:
                failed += [DeleteFailure(s, str(e), True) for s, _ in folders[i + 1 :]]
                break
    return failed


def _permanent(error: BaseException) -> bool:
    # A StorageError is a transient error that outlived its retries: a later run may pass.
    if isinstance(error, StorageAccessError):
        return True
    return not isinstance(error, StorageError) and classify_error(error) is not Failure.TRANSIENT


def retention_targets(cat: Catalog, plan: RetentionPlan) -> list[tuple[int, str]]:
    """``(step, folder name)`` of what ``plan`` deletes: the lineage's steps, then the
    abandoned folders of rolled-back timelines."""
    abandoned = [(f.step, n) for n in plan.abandoned if (f := mf.parse_step_dir(n)) is not None]
    return [(s, cat.names.get(s) or mf.step_dir(s)) for s in plan.delete] + abandoned


def apply_retention(storage: Storage, keep: int, *, dry_run: bool = False) -> list[int]:
    """Delete checkpoints beyond the ``keep`` newest committed ones (and abandoned partial
    folders). Returns the deleted steps. Never touches the newest committed checkpoint.

    Raises:
        RetentionError: some folders were not deleted (the others were).
    """
    cat = scan(storage)
    plan = plan_retention(cat, keep)
    if not dry_run:
        failed = delete_folders(storage, retention_targets(cat, plan))
        if failed:
            raise RetentionError(failed)
    return plan.delete
