"""Messages between the driver and its workers, and the authenticated socket that carries them.

Every executor (local processes, Ray actors, torchrun's processes) uses this same channel: a
worker connects back to the driver, says which rank it is (``Hello``), proves it holds that
rank's credential, is told where the attempt starts (``Start``), and then talks in the messages
below. (How the train function reaches a worker is the executor's business.)
The driver answers each ``Report`` only when every rank has sent it, which makes ``report()``
a barrier without any polling.

Who may speak as whom (see :class:`DriverListener`):

- each rank has a credential of its own, derived from the run's secret, which only the driver
  holds; a peer proves the credential of the rank its ``Hello`` names, and the driver proves it
  too, so a rank only ever talks to its real driver;
- a ``Hello`` for a rank outside the group, or for a rank that has connected already, is
  refused before any challenge;
- a message's rank is the rank of the connection it came on: one that claims another rank, or
  that only the driver sends, ends that rank's channel (:func:`check_sender`).

Messages travel as JSON (a report in a fixed binary layout), never as pickles: reading one can
build nothing but plain data and the dataclasses listed in ``MESSAGE_TYPES`` (see
:mod:`lockstep._internal.wire.codec`). Two fields carry pickles that only their proven
sender's peers unpickle: rank 0's return value (unpickled by the driver) and rank 0's broadcast
object (forwarded by the driver, unpickled by the ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.persist.storage import CheckpointEntry
from lockstep._internal.rank.step_timing import StepTimes
from lockstep.errors import WorkerFailure

# -- worker -> driver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message of a worker, before it proves its credential: its rank, its process id, its
    host name (as the worker reads it; shown in the run record's ``ranks``, never trusted) and a
    fresh random ``nonce`` (hex) that the driver's proof must cover."""

    rank: int
    pid: int
    host: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class Proof:
    """The worker's proof that it holds the credential of the rank its Hello named: an HMAC of
    both nonces (hex; see :mod:`lockstep._internal.wire.channel`)."""

    proof: str


@dataclass(frozen=True)
class Report:
    """One rank's ``report()`` call. Only rank 0 sends metrics (as a JSON string).

    ``checkpoint_state`` says where this rank's checkpoint files are: ``"written"`` (in the
    checkpoint folder already), ``"uploading"`` (an ASYNC upload follows with
    :class:`CheckpointUploaded`) or ``"external"`` (NO_UPLOAD: registered where it is, at
    ``external_path``); None when this rank passed no checkpoint. ``step_times``: where the
    rank's time since its previous report went (see :mod:`lockstep._internal.rank.step_timing`).
    ``validation``: what ``report(validation=...)`` asked for with this rank's checkpoint
    (True: the defaults; a dict: a ValidationTaskConfig's ``fn_kwargs`` and ``timeout_s``).
    ``files``: with ``"written"``, each file's ``[relative path, size, checksum]`` for the
    checkpoint's manifest (:mod:`lockstep._internal.persist.manifest`).
    """

    rank: int
    index: int
    metrics_json: str | None
    checkpoint_dir_name: str | None = None
    checkpoint_state: str | None = None
    external_path: str | None = None
    step_times: StepTimes | None = None
    validation: bool | dict[str, Any] | None = None
    files: list[Any] | None = None


@dataclass(frozen=True)
class WritingCheckpoint:
    """A rank is about to write files into checkpoint folder ``dir_name`` (so that the driver
    can remove the folder if the attempt fails before the checkpoint is committed)."""

    rank: int
    dir_name: str


@dataclass(frozen=True)
class CheckpointUploaded:
    """A rank's ASYNC upload for report ``index`` ended (``error`` says why it failed).
    ``external_path`` is set when a ``checkpoint_upload_fn`` put the checkpoint somewhere other
    than its folder in the run. ``files``: as :class:`Report`'s, for the files it copied."""

    rank: int
    index: int
    dir_name: str
    error: str | None = None
    external_path: str | None = None
    files: list[Any] | None = None


@dataclass(frozen=True)
class StorageOutage:
    """A storage outage the rank rode out (its storage operations were retried until storage
    answered again): when it began (wall time), how long it lasted, how many retries it took."""

    rank: int
    started_at: float
    lasted_s: float
    retries: int


@dataclass(frozen=True)
class Collective:
    """A rank entered its collective number ``seq`` (``barrier`` or ``broadcast_from_rank_zero``,
    named in ``op``). Rank 0 of a broadcast sends its object pickled; the driver never unpickles
    it, it only hands the bytes on to the other ranks."""

    rank: int
    seq: int
    op: str
    data: bytes | None = None


@dataclass(frozen=True)
class CheckpointsQuery:
    """``get_all_reported_checkpoints()``: the rank wants the run's checkpoints once those of
    every report before ``before_index`` are committed (and, when ``validated``, once no
    validation is pending), or after ``timeout_s`` as they are then."""

    rank: int
    before_index: int
    validated: bool = False
    timeout_s: float | None = None


@dataclass(frozen=True)
class Output:
    """Bytes a rank wrote to stdout or stderr (sent by executors whose workers' output doesn't
    reach the driver through a pipe, such as Ray actors on other nodes)."""

    rank: int
    is_stderr: bool
    data: bytes


@dataclass(frozen=True)
class PreemptionNotice:
    """A rank on ``host`` is being taken away: its process got SIGTERM (sent from a thread the
    rank's signal handler starts, at any time; ``urgent``: a second one, stop at once), or
    another ``cause`` (a Ray node drain, with Ray's deadline ``deadline_ms`` when it has one)."""

    rank: int
    host: str
    urgent: bool = False
    cause: str = "SIGTERM"
    deadline_ms: int | None = None


@dataclass(frozen=True)
class Progress:
    """A rank's progress, sent by its progress thread when it changed, at most every
    ``Start.progress_every_s`` (see :mod:`lockstep._internal.rank.progress`).

    Attributes:
        work: A count that grows with every unit of work the rank does: training steps, forward
            passes of a prepared model, batches of a prepared loader, reports, collectives.
        steps: Training steps completed (``optimizer.step()`` calls).
        busy: Whether the rank is in lockstep's own long work (saving or uploading a checkpoint),
            which counts as progress for as long as it lasts.
        step_s: The median of the rank's recent step times, once it has two steps.
    """

    rank: int
    work: int
    steps: int
    busy: bool = False
    step_s: float | None = None


@dataclass(frozen=True)
class Stacks:
    """A rank's answer to :class:`StacksWanted`: where it is.

    Attributes:
        stacks: The Python stacks of its threads (lockstep's own left out).
        collective: The torch.distributed collective it waits in, as torch's flight recorder
            names it (e.g. ``gloo:all_reduce``, with its sequence number), or None.
        collectives_known: Whether the flight recorder was on (so None above means: in none).
        work: As in :class:`Progress`, now.
    """

    rank: int
    stacks: str
    collective: str | None = None
    collectives_known: bool = False
    work: int = 0


@dataclass(frozen=True)
class Finished:
    """The train function returned; rank 0 sends its pickled return value."""

    rank: int
    return_value: bytes | None


@dataclass(frozen=True)
class Failed:
    """The train function (or the worker's set-up) raised."""

    failure: WorkerFailure


# -- driver -> worker ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    """The driver's answer to a Hello it accepts: its own fresh ``nonce`` (hex) and its proof
    that it holds the rank's credential, an HMAC of both nonces (hex)."""

    nonce: str
    proof: str


@dataclass(frozen=True)
class Start:
    """The driver's answer to ``Hello``: where this attempt starts.

    Attributes:
        first_report_index: The index of the rank's first ``report()``.
        checkpoint: The run's latest committed checkpoint (its record entry), if it has one.
        from_resume_checkpoint: With no checkpoint of the run's own, whether to start from the
            trainer's ``resume_from_checkpoint``.
        used_dir_names: Checkpoint folder names the run has used already.
        progress_every_s: How often, at most, the rank sends :class:`Progress` (None: never,
            the hang detector is off).
    """

    first_report_index: int
    checkpoint: CheckpointEntry | None = None
    from_resume_checkpoint: bool = False
    used_dir_names: list[str] = field(default_factory=list)
    progress_every_s: float | None = None


@dataclass(frozen=True)
class Preempted:
    """The run's preemption notice, as ranks learn it (the fields of ``lockstep.PreemptionInfo``)."""

    deadline_ms: int | None
    node_to_ranks: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportDone:
    """Every rank has made report ``index`` and it is recorded. ``new_latest_checkpoint`` is
    the newest committed checkpoint's record entry when it changed since the previous
    ReportDone, else None. ``preempted`` is the preemption notice once there is one; with
    ``stop``, the run stops here (preempted) and ``report()`` does not return."""

    index: int
    new_latest_checkpoint: CheckpointEntry | None = None
    preempted: Preempted | None = None
    stop: bool = False


@dataclass(frozen=True)
class CollectiveDone:
    """Every rank has entered collective ``seq``; ``data`` is rank 0's pickled object (broadcast)."""

    seq: int
    data: bytes | None = None


@dataclass(frozen=True)
class StacksWanted:
    """The driver suspects a hang: the rank answers with :class:`Stacks`, at once when its train
    function waits for the driver, else from its progress thread."""


@dataclass(frozen=True)
class ReportedCheckpoints:
    """The answer to a :class:`CheckpointsQuery`: the run's kept checkpoints, with their metrics."""

    checkpoints: list[CheckpointEntry] = field(default_factory=list)


def checkpoint_ref(entry: CheckpointEntry | None) -> CheckpointEntry | None:
    """A record entry as ranks are told of it: what names the checkpoint, without its metrics."""
    return dataclasses.replace(entry, metrics={}) if entry is not None else None


# -- encoding ------------------------------------------------------------------------------------

#: What a worker sends on its channel (anything else from a worker is refused).
WORKER_MESSAGES = (
    Hello,
    Report,
    WritingCheckpoint,
    CheckpointUploaded,
    StorageOutage,
    Collective,
    CheckpointsQuery,
    Output,
    PreemptionNotice,
    Finished,
    Failed,
    Progress,
    Stacks,
)

MESSAGE_TYPES: dict[str, type] = {
    kind.__name__: kind
    for kind in (
        *WORKER_MESSAGES,
        Proof,
        Challenge,
        Start,
        Preempted,
        ReportDone,
        CollectiveDone,
        ReportedCheckpoints,
        StacksWanted,
        WorkerFailure,
        CheckpointEntry,
        StepTimes,
    )
}
