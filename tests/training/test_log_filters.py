"""LoggerConfig's filters: filter_warnings, modules_to_filter, set_level_for_all_loggers."""

from __future__ import annotations

import logging

import pytest

from longspan.core.logging import configure_log_filters


@pytest.fixture
def root_records():
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Grab(level=logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield records
    root.removeHandler(handler)
    root.setLevel(old_level)
    configure_log_filters(filter_warnings=False)  # remove the filters again


def _names(records):
    return [(r.name, r.levelname, r.getMessage()) for r in records]


def test_filter_warnings_drops_third_party_warnings_only(root_records) -> None:
    third_party = logging.getLogger("thirdparty.module")
    third_party.setLevel(logging.DEBUG)
    configure_log_filters(filter_warnings=True)
    third_party.warning("noisy")
    third_party.info("useful")
    logging.getLogger("created.later").warning("noisy too")  # a logger made after the call: the handler filters
    assert ("thirdparty.module", "WARNING", "noisy") not in _names(root_records)
    assert ("thirdparty.module", "INFO", "useful") in _names(root_records)
    assert not [r for r in root_records if r.name == "created.later"]
    configure_log_filters(filter_warnings=False)
    third_party.warning("noisy")
    assert ("thirdparty.module", "WARNING", "noisy") in _names(root_records)


def test_longspan_warnings_stay_visible() -> None:
    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("longspan")
    handler = Grab(level=logging.DEBUG)
    lg.addHandler(handler)
    try:
        configure_log_filters(filter_warnings=True)
        logging.getLogger("longspan.training.x").warning("about your setting")
        assert seen == ["about your setting"]
    finally:
        lg.removeHandler(handler)
        configure_log_filters(filter_warnings=False)


def test_modules_to_filter_drops_every_record_of_those_loggers(root_records) -> None:
    logging.getLogger("noisy.lib").setLevel(logging.DEBUG)
    configure_log_filters(filter_warnings=False, modules_to_filter=["noisy"])
    logging.getLogger("noisy.lib").error("dropped")
    logging.getLogger("noisyneighbour").error("kept: a different name, not a child")
    logging.getLogger("quiet.lib").error("kept")
    messages = [m for _, _, m in _names(root_records)]
    assert "dropped" not in messages and "kept" in messages and "kept: a different name, not a child" in messages


@pytest.fixture
def restore_logger_levels():
    """set_level_for_all_loggers changes every logger's level: put them back for the tests that follow."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    levels = [(lg, lg.level) for lg in loggers]
    yield
    for lg, level in levels:
        lg.setLevel(level)


def test_set_level_for_all_loggers(root_records, restore_logger_levels) -> None:
    other = logging.getLogger("some.library")
    other.setLevel(logging.DEBUG)
    configure_log_filters(logging.WARNING, filter_warnings=False, set_level_for_all_loggers=False)
    assert other.level == logging.DEBUG
    configure_log_filters(logging.WARNING, filter_warnings=False, set_level_for_all_loggers=True)
    assert other.level == logging.WARNING and logging.getLogger().level == logging.WARNING
