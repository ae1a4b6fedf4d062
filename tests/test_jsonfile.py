"""JSON records written whole: read back as written, private where asked, none where torn."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.jsonfile import LineTail, read_json, write_json


@pytest.mark.timeout(30)
def test_a_record_is_read_back_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "made" / "record.json"
    write_json(path, {"a": 1, "b": [2, 3]})
    assert read_json(path) == {"a": 1, "b": [2, 3]}
    write_json(path, {"a": 2})
    assert read_json(path) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]


@pytest.mark.timeout(30)
def test_a_private_record_is_this_user_s_only(tmp_path: Path) -> None:
    write_json(tmp_path / "secret.json", {"secret": "s"}, private=True)
    assert (tmp_path / "secret.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_without_parents_a_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_json(tmp_path / "gone" / "record.json", {}, parents=False)
    assert not (tmp_path / "gone").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", [None, "", '{"a": ', "[1, 2]", "3"])
def test_no_record_where_it_is_missing_torn_or_not_an_object(tmp_path: Path,
                                                             text: str | None) -> None:
    path = tmp_path / "record.json"
    if text is not None:
        path.write_text(text)
    assert read_json(path) is None


@pytest.mark.timeout(30)
def test_a_tail_hands_each_complete_line_once_and_a_partial_one_when_it_ends(
        tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    tail = LineTail()
    assert tail.new_lines(path) == []  # not there yet
    path.write_bytes(b'{"a": 1}\n{"b": ')
    assert tail.new_lines(path) == [b'{"a": 1}']
    assert tail.new_lines(path) == []
    with open(path, "ab") as f:
        f.write(b'2}\n{"c": 3}\n')
    assert tail.new_lines(path) == [b'{"b": 2}', b'{"c": 3}']
