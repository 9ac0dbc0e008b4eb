"""A conversation bench cut off and resumed (bench/warm_turns.py --state, bench/checkpoint.py)
is the conversation that ran on: on real `hetero up` stacks with the tiny model.

The decoder's native pass over a 40K-token conversation is hours of one core on the CI
machine, longer than one of its sessions; the bench saves the decoder's own rows after every
turn and a later run mounts them into a fresh stack. These tests hold that to the bits: the
rows the decoder holds for the next turn, after a resume, are byte for byte those it holds
having run through, and the answers are the same.
"""

import sys

import pytest
from frontstack import HETERO, ROOT, TINY, need

sys.path.insert(0, str(ROOT / "bench"))
from checkpoint import Checkpoint  # noqa: E402
from warm_turns import run_conversation, user_turns  # noqa: E402

TURNS = user_turns(4, 40, 90, seed=7)
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def _needs():
    need(HETERO, "hetero binary")
    need(TINY / "config.json", "tiny test model")


def answers(rows: list) -> list:
    return [r["answer"] for r in rows]


def test_a_resumed_native_pass_holds_the_bits_it_would_have_held(tmp_path) -> None:
    through = Checkpoint(tmp_path / "through", "native")
    ran = run_conversation(TINY, TURNS, "native", MAX_TOKENS, saved=through, stop_after=3)
    cut = Checkpoint(tmp_path / "cut", "native")
    first = run_conversation(TINY, TURNS, "native", MAX_TOKENS, saved=cut, stop_after=2)
    assert len(first) == 2 and cut.load(TURNS)["B"] > 0
    resumed = run_conversation(TINY, TURNS, "native", MAX_TOKENS, saved=cut, stop_after=3)

    assert [r["resumed"] for r in resumed] == [False, False, True]
    assert answers(resumed) == answers(ran)
    # The decoder reused as much of turn 3's prompt as it would have...
    assert [r["cached_tokens"] for r in resumed] == [r["cached_tokens"] for r in ran]
    assert resumed[2]["cached_tokens"] > 0
    # ...and after it holds the same rows for turn 4's, to the byte.
    a, b = through.load(TURNS), cut.load(TURNS)
    assert a["B"] == b["B"] > resumed[2]["T"]
    assert (through.dir / a["cache"]).read_bytes() == (cut.dir / b["cache"]).read_bytes()


def test_a_resumed_bridged_pass_answers_as_the_decoder(tmp_path) -> None:
    turns = user_turns(3, 300, 400, seed=7)  # tails past the front's minimum: bridged
    native = run_conversation(TINY, turns, "native", MAX_TOKENS)
    saved = Checkpoint(tmp_path / "state", "bridged")
    run_conversation(TINY, turns, "", MAX_TOKENS, saved=saved, stop_after=1)
    rows = run_conversation(TINY, turns, "", MAX_TOKENS, saved=saved)
    assert answers(rows) == answers(native)
    assert all(r["confirmed"] and r["verdict"] == "complete" for r in rows), rows
    # The resumed turn's tail goes onto the rows the checkpoint mounted; the prefill host,
    # fresh, computed its prefix again (its own state is not saved).
    second = rows[1]
    assert second["resumed"] and second["start"] > 0
    assert second["computed"] > second["T"] - second["start"]


def test_another_conversations_state_is_refused(tmp_path) -> None:
    saved = Checkpoint(tmp_path / "state", "native")
    run_conversation(TINY, TURNS, "native", MAX_TOKENS, saved=saved, stop_after=1)
    with pytest.raises(RuntimeError, match="another conversation"):
        run_conversation(TINY, TURNS[::-1], "native", MAX_TOKENS, saved=saved)


def test_the_native_pass_alone_then_both_writes_one_table(tmp_path) -> None:
    """--no-bridged saves the native pass; a run with both passes loads it (not run again) and
    writes the table with both."""
    import json
    import subprocess
    import sys

    def bench(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ROOT / "bench" / "warm_turns.py"), "--model", str(TINY),
               "--turns", "2", "--min-words", "40", "--max-words", "60", "--state",
               str(tmp_path / "state"), "--out-dir", str(tmp_path / "out"), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)

    first = bench("--no-bridged")
    assert first.returncode == 0, first.stderr
    assert "bridged turn" not in first.stdout and not list((tmp_path / "out").glob("*.jsonl"))
    native = Checkpoint(tmp_path / "state", "native").load(user_turns(2, 40, 60, seed=1))["rows"]
    both = bench()
    assert both.returncode == 0, both.stderr
    assert "native turn" not in both.stdout  # loaded, not run again
    (table,) = (tmp_path / "out").glob("warm-turns-*.jsonl")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert [r["native"]["wall_s"] for r in rows] == [r["wall_s"] for r in native]
    assert all(r["answer_equal"] for r in rows)
