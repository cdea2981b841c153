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

Messages travel as JSON, never as pickles: reading one can build nothing but the dataclasses
listed in ``MESSAGE_TYPES``. Two fields carry pickles that only their proven sender's peers
unpickle: rank 0's return value (unpickled by the driver) and rank 0's broadcast object
(forwarded by the driver, unpickled by the ranks).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lockstep._internal.persist.storage import CheckpointEntry
from lockstep._internal.rank.step_timing import StepTimes
from lockstep.errors import WorkerFailure

# -- worker -> driver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First message of a worker, before it proves its credential: its rank and process id."""

    rank: int
    pid: int


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
    """

    rank: int
    index: int
    metrics_json: str | None
    checkpoint_dir_name: str | None = None
    checkpoint_state: str | None = None
    external_path: str | None = None
    step_times: StepTimes | None = None
    validation: bool | dict[str, Any] | None = None


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
    than its folder in the run."""

    rank: int
    index: int
    dir_name: str
    error: str | None = None
    external_path: str | None = None


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
class Start:
    """The driver's answer to ``Hello``: where this attempt starts.

    Attributes:
        first_report_index: The index of the rank's first ``report()``.
        checkpoint: The run's latest committed checkpoint (its record entry), if it has one.
        from_resume_checkpoint: With no checkpoint of the run's own, whether to start from the
            trainer's ``resume_from_checkpoint``.
        used_dir_names: Checkpoint folder names the run has used already.
    """

    first_report_index: int
    checkpoint: CheckpointEntry | None = None
    from_resume_checkpoint: bool = False
    used_dir_names: list[str] = field(default_factory=list)


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
    Collective,
    CheckpointsQuery,
    Output,
    PreemptionNotice,
    Finished,
    Failed,
)

MESSAGE_TYPES: dict[str, type] = {
    kind.__name__: kind
    for kind in (
        *WORKER_MESSAGES,
        Start,
        Preempted,
        ReportDone,
        CollectiveDone,
        ReportedCheckpoints,
        WorkerFailure,
        CheckpointEntry,
        StepTimes,
    )
}
TYPE_KEY = "~type"
BYTES_KEY = "~bytes"


def encode(message: Any) -> bytes:
    """A message as JSON bytes."""
    return json.dumps(_plain(message), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message that :func:`encode` made.

    Raises:
        ValueError: ``data`` is not such a message.
    """
    return _rebuilt(json.loads(data))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and type(value).__name__ in MESSAGE_TYPES:
        fields = {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
        return {TYPE_KEY: type(value).__name__, **fields}
    if isinstance(value, bytes):
        return {BYTES_KEY: base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} can't travel on lockstep's channel")


def _rebuilt(value: Any) -> Any:
    if isinstance(value, list):
        return [_rebuilt(item) for item in value]
    if not isinstance(value, dict):
        return value
    if BYTES_KEY in value:
        return base64.b64decode(value[BYTES_KEY])
    fields = {key: _rebuilt(item) for key, item in value.items() if key != TYPE_KEY}
    if TYPE_KEY not in value:
        return fields
    kind = MESSAGE_TYPES.get(value[TYPE_KEY])
    if kind is None:
        raise ValueError(f"unknown message type {value[TYPE_KEY]!r} on lockstep's channel")
    try:
        return kind(**fields)
    except TypeError as error:
        raise ValueError(f"a malformed {kind.__name__} on lockstep's channel: {error}") from error
