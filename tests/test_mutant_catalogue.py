"""The mutant catalogue stays true to the code: every entry's text occurs exactly once in its
file, its replacement differs, its test files exist, and ids are unique (`make mutants` runs
the mutants themselves; too slow for `make test`)."""

from __future__ import annotations

from mutants.run import load, problems


def test_every_mutant_applies_to_todays_code() -> None:
    mutants = load()
    assert len(mutants) >= 3
    assert [p for m in mutants for p in problems(m)] == []


def test_every_mutant_names_the_tests_that_kill_it_and_why() -> None:
    for m in load():
        assert m.tests and (m.why or m.equivalent), m.id
