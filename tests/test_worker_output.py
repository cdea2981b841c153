"""worker_output="all": a line every rank prints is shown once, tagged with the ranks; a rank's
own lines keep their order, nothing waits longer than the merge bound, progress bars pass
through, and each rank's log file still gets all of its output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.output.worker_output import MergingConsole, OutputRelay, rank_tag
from lockstep.torch import TorchTrainer

WAIT_S = 0.5


class Console:
    """A MergingConsole whose shown text is kept, fed with a clock the test moves."""

    def __init__(self, ranks: int = 2) -> None:
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.now = 100.0
        self.merging = MergingConsole(self._show, WAIT_S)
        self.merging.ranks.update(range(ranks))

    def _show(self, text: bytes, is_stderr: bool) -> None:
        (self.err if is_stderr else self.out).append(text)

    def feed(self, rank: int, chunk: bytes, is_stderr: bool = False, after_s: float = 0.0) -> None:
        self.now += after_s
        self.merging.take(rank, chunk, is_stderr, self.now)

    def tick(self, after_s: float) -> None:
        self.now += after_s
        self.merging.show_due(self.now)

    @property
    def text(self) -> str:
        return b"".join(self.out).decode()


def test_a_line_every_rank_prints_is_shown_once_with_their_ranks() -> None:
    console = Console(ranks=4)
    for rank in (2, 0, 3, 1):
        console.feed(rank, b"epoch 1\n")
    assert console.text == "[ranks 0-3] epoch 1\n"


def test_it_is_shown_as_soon_as_the_last_rank_prints_it() -> None:
    console = Console()
    console.feed(0, b"starting\n")
    assert console.text == ""
    console.feed(1, b"starting\n", after_s=0.1)
    assert console.text == "[ranks 0-1] starting\n"


def test_lines_arriving_in_pieces_are_merged_whole() -> None:
    console = Console()
    console.feed(0, b"sta")
    console.feed(1, b"starting\nloss 0.5")
    console.feed(0, b"rting\nloss 0.7\n")
    console.feed(1, b"\n")
    assert console.text == "[ranks 0-1] starting\n"
    console.tick(WAIT_S)
    assert console.text == "[ranks 0-1] starting\n[rank 0] loss 0.7\n[rank 1] loss 0.5\n"


def test_a_line_only_one_rank_prints_waits_at_most_the_bound() -> None:
    console = Console()
    console.feed(1, b"only rank 1 says this\n")
    console.tick(WAIT_S - 0.01)
    assert console.text == ""
    console.tick(0.01)
    assert console.text == "[rank 1] only rank 1 says this\n"


def test_a_rank_ahead_by_several_lines_still_merges_and_keeps_its_order() -> None:
    console = Console()
    console.feed(0, b"a\nmine 0\nb\nc\n")
    console.feed(1, b"a\nb\n", after_s=0.2)
    assert console.text == "[ranks 0-1] a\n[rank 0] mine 0\n[ranks 0-1] b\n"
    console.feed(1, b"c\n", after_s=0.2)
    assert console.text.endswith("[ranks 0-1] b\n[ranks 0-1] c\n")


def test_each_rank_keeps_its_own_order_when_twins_come_in_another_order() -> None:
    console = Console()
    console.feed(0, b"x\ny\n")
    console.feed(1, b"y\nx\n")
    console.tick(WAIT_S)
    lines = console.text.splitlines()
    rank_0 = [line.split("] ", 1)[1] for line in lines if "0" in line.split("] ", 1)[0]]
    rank_1 = [line.split("] ", 1)[1] for line in lines if "1" in line.split("] ", 1)[0]]
    assert rank_0 == ["x", "y"] and rank_1 == ["y", "x"]
    assert len(lines) == 3  # one of the two lines is merged, the other can't be without reordering


def test_repeated_lines_pair_up_in_order() -> None:
    console = Console()
    console.feed(0, b"same\nsame\n")
    console.feed(1, b"same\n")
    assert console.text == "[ranks 0-1] same\n"
    console.feed(1, b"same\n")
    assert console.text == "[ranks 0-1] same\n[ranks 0-1] same\n"


def test_some_of_the_ranks_are_named_by_spans() -> None:
    console = Console(ranks=6)
    for rank in (0, 1, 2, 4):
        console.feed(rank, b"hi\n")
    console.tick(WAIT_S)
    assert console.text == "[ranks 0-2,4] hi\n"
    assert rank_tag({3}) == b"[rank 3] " and rank_tag({1, 3, 5}) == b"[ranks 1,3,5] "


def test_stdout_and_stderr_are_merged_apart() -> None:
    console = Console()
    console.feed(0, b"warn\n", is_stderr=True)
    console.feed(1, b"warn\n")
    console.feed(1, b"warn\n", is_stderr=True)
    assert b"".join(console.err) == b"[ranks 0-1] warn\n"
    console.tick(WAIT_S)
    assert console.text == "[rank 1] warn\n"


def test_progress_bars_pass_through_at_once_after_the_ranks_earlier_lines() -> None:
    console = Console()
    console.feed(0, b"epoch 1\n")
    console.feed(0, b"\r 10%|#")
    assert console.text == "[rank 0] epoch 1\n[rank 0] \r 10%|#"
    console.feed(0, b"\r 50%|#####")
    console.feed(0, b"\r100%|##########\n")
    assert console.text.endswith("\r 50%|#####\r100%|##########\n")
    console.feed(0, b"next\n")
    console.feed(1, b"next\n")
    assert console.text.endswith("\n[ranks 0-1] next\n")


def test_text_without_a_newline_is_shown_after_the_bound_and_its_line_finished_raw() -> None:
    console = Console()
    console.feed(1, b"loading...")
    console.tick(WAIT_S)
    assert console.text == "[rank 1] loading..."
    console.feed(1, b" done\n")
    assert console.text == "[rank 1] loading... done\n"


def test_a_single_rank_run_shows_lines_at_once() -> None:
    console = Console(ranks=1)
    console.feed(0, b"hello\n")
    assert console.text == "[rank 0] hello\n"


def test_a_rank_flooding_the_console_holds_a_bounded_number_of_lines() -> None:
    console = Console()
    console.feed(0, b"".join(f"line {index}\n".encode() for index in range(5000)))
    assert len(console.out) >= 4000 and console.out[0] == b"[rank 0] line 0\n"


def test_the_relay_keeps_every_byte_in_the_logs_and_its_timer_shows_held_lines(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    relay = OutputRelay(str(tmp_path), "all", merge_wait_s=0.2)
    relay.expect(0)
    relay.expect(1)
    relay.write(0, b"same\nonly 0\n", False)
    relay.write(1, b"same\nprogress\r", False)
    shown = capfd.readouterr().out
    assert shown == "[ranks 0-1] same\n[rank 1] progress\r"
    time.sleep(0.6)  # no more output comes: the timer must show rank 0's held line by itself
    assert capfd.readouterr().out == "[rank 0] only 0\n"
    relay.write(1, b"tail without newline", True)
    relay.close()
    assert capfd.readouterr().err == "[rank 1] tail without newline"
    assert (tmp_path / "rank_0.log").read_bytes() == b"same\nonly 0\n"
    assert (tmp_path / "rank_1.log").read_bytes() == b"same\nprogress\rtail without newline"


def print_a_shared_and_an_own_line() -> None:
    import sys

    import torch.distributed as dist

    rank = lockstep.get_context().get_world_rank()
    dist.barrier()  # "at the same point": ranks start their train functions up to seconds apart on a loaded machine
    print("every rank says this", flush=True)
    print(f"only rank {rank} says this", flush=True)
    print("and this on stderr", file=sys.stderr, flush=True)
    lockstep.report({"rank": rank})


@pytest.mark.timeout(120)
def test_two_workers_printing_the_same_line_show_it_once(storage_path: str, capfd: pytest.CaptureFixture[str]) -> None:
    run = RunConfig(name="merged", storage_path=storage_path, worker_output="all")
    TorchTrainer(print_a_shared_and_an_own_line, scaling_config=ScalingConfig(num_workers=2), run_config=run).fit()
    console = capfd.readouterr()
    assert console.out.count("every rank says this") == 1
    assert "[ranks 0-1] every rank says this\n" in console.out
    assert "[rank 0] only rank 0 says this\n" in console.out and "[rank 1] only rank 1 says this\n" in console.out
    assert "[ranks 0-1] and this on stderr\n" in console.err
    for rank in (0, 1):
        log = Path(storage_path, "merged", "logs", f"rank_{rank}.log").read_text()
        # stdout and stderr come through two pipes: each keeps its order, a stderr line may land
        # between two stdout lines
        stdout_lines = [line for line in log.splitlines() if line != "and this on stderr"]
        assert "\n".join(stdout_lines).find(f"every rank says this\nonly rank {rank} says this") >= 0, log
        assert "and this on stderr" in log


def test_a_relayed_ranks_first_stderr_chunk_without_a_line_end_is_taken(tmp_path: Path) -> None:
    relay = OutputRelay(str(tmp_path), "rank0")
    relay.write(1, b"loading...", True)  # a Ray rank's first output, over the channel
    relay.write(1, b" done\n", True)
    relay.close()
    assert (tmp_path / "rank_1.log").read_bytes() == b"loading... done\n"
    assert relay.stderr_tail(1) == "loading... done\n"


def test_unfinished_lines_of_two_ranks_never_run_together_and_keep_their_tags() -> None:
    shown: list[bytes] = []
    console = MergingConsole(lambda text, is_stderr: shown.append(text), wait_s=0.0)
    console.ranks = {0, 1}
    console.take(1, b"\rprogress 0/3", False, 0.0)
    console.take(0, b"no newline from rank 0", False, 0.0)
    console.take(1, b"\rprogress 1/3", False, 0.0)
    console.show_all()
    assert b"".join(shown) == (b"[rank 1] \rprogress 0/3\n[rank 0] no newline from rank 0\n[rank 1] \rprogress 1/3"), (
        b"".join(shown)
    )


def test_a_failure_tail_shows_a_progress_bars_last_state_not_every_one(tmp_path: Path) -> None:
    relay = OutputRelay(str(tmp_path), "none")
    relay.write(0, b"epoch 1\n" + b"".join(b"\r%d%%" % percent for percent in range(0, 101, 5)) + b"\n", True)
    relay.write(0, b"Traceback: boom\n", True)
    relay.close()
    assert relay.stderr_tail(0) == "epoch 1\n100%\nTraceback: boom\n"
