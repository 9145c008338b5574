"""What a run says while it works: a line for a long quiet phase with the time left, and durations as people
read them."""

from __future__ import annotations

from hanzo_gym.loops.run_dir import Progress


def test_a_long_phase_says_how_far_it_is_and_how_long_is_left(monkeypatch, capsys):
    from hanzo_gym import clock

    now = iter([0.0, 0.0, 5.0, 16.0, 20.0, 40.0])  # start, then before each of 5 items
    monkeypatch.setattr(clock.time, "monotonic", lambda: next(now))
    assert list(clock.paced(list("abcde"), "tokenizing rows.jsonl")) == list("abcde")
    # a line once 15 s have passed since the last one: after 2 items in 16 s, then after 4 in 40 s
    assert capsys.readouterr().out.splitlines() == [
        "tokenizing rows.jsonl: 2 of 5, 24 s left",
        "tokenizing rows.jsonl: 4 of 5, 10 s left",
    ]
    monkeypatch.setenv("RANK", "1")  # under torchrun rank 0 alone speaks
    now = iter([0.0, 0.0, 20.0, 40.0])
    assert list(clock.paced([1, 2, 3], "tokenizing")) == [1, 2, 3]
    assert capsys.readouterr().out == ""


def test_durations_read_as_people_write_them():
    from hanzo_gym.clock import duration

    assert [duration(s) for s in (0.4, 40, 140, 3725)] == ["0 s", "40 s", "2 min 20 s", "1 h 2 min"]


def test_piped_training_says_where_it_is_when_no_line_came_for_a_while(monkeypatch, capsys):
    from hanzo_gym.loops import run_dir

    clock_now = iter([100.0, 110.0, 140.0, 150.0, 150.0])  # the start, then at each step
    monkeypatch.setattr(run_dir.time, "monotonic", lambda: next(clock_now))
    monkeypatch.setattr(run_dir.sys.stderr, "isatty", lambda: False)
    progress = Progress(total=10, done=2)  # resumed at step 2
    progress.advance()  # step 3 at 110 s: 10 s since the start, quiet
    progress.advance()  # step 4 at 140 s: 40 s without a line
    assert capsys.readouterr().out == "step 4/10 · 2 min 0 s left\n"  # 20 s a step, 6 to go
    progress.advance()  # step 5: the line just came
    assert capsys.readouterr().out == ""
