"""Tests for minifloat.train.slots: the newest N checkpoints of a run, by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from minifloat.train.slots import existing_slots, rotate, slot_path


def _files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir()) if p.is_file()}


def _save(path: Path, keep: int, text: str) -> None:
    """What a save does: rotate, then put the new checkpoint at the newest name."""
    rotate(path, keep)
    new = path.with_name(".new")
    new.write_text(text)
    new.replace(path)  # atomic, as save_checkpoint does: a hard-linked slot keeps the old data


def test_names() -> None:
    path = Path("run/checkpoint.pt")
    assert slot_path(path, 0) == path
    assert slot_path(path, 2) == Path("run/checkpoint.2.pt")
    assert slot_path(Path("run/checkpoint.dcp"), 1) == Path("run/checkpoint.1.dcp")


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keeps_the_newest_n(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "checkpoint.pt"
    for step in range(1, 6):
        _save(path, keep, f"step {step}")
    expected = {slot_path(path, i).name: f"step {5 - i}" for i in range(keep)}
    assert _files(tmp_path) == expected
    assert existing_slots(path) == [slot_path(path, i) for i in range(keep)]


def test_the_newest_never_disappears_and_the_old_one_is_a_hard_link(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_text("step 1")
    rotate(path, 2)
    assert path.read_text() == "step 1" and slot_path(path, 1).read_text() == "step 1"
    assert path.stat().st_ino == slot_path(path, 1).stat().st_ino


def test_a_free_newest_slot_is_filled_without_shifting(tmp_path: Path) -> None:
    # After a crash between two renames, or once a damaged newest checkpoint was removed.
    path = tmp_path / "checkpoint.pt"
    slot_path(path, 1).write_text("step 4")
    slot_path(path, 5).write_text("left by a run with more slots")
    rotate(path, 2)
    assert _files(tmp_path) == {"checkpoint.1.pt": "step 4"}


def test_directories_rotate_by_rename(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.dcp"
    for step in (1, 2, 3):
        rotate(path, 2)
        path.mkdir()
        (path / "step").write_text(str(step))
    assert (path / "step").read_text() == "3"
    assert (slot_path(path, 1) / "step").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.dcp", "checkpoint.dcp"]
